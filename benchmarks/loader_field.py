"""rt.data.Loader side by side with the loaders people reach for, on their own formats.

Loaders (each with its documented best settings, all at the same worker count and
batch size; install them with ``pip install -e '.[bench]'``, torch pinned):

  ringtrain            rt.data.Loader (map-style data, ImageFolder, TarShards)
  torchdata_stateful   torchdata.stateful_dataloader.StatefulDataLoader, persistent workers
  torchdata_nodes      torchdata.nodes: SamplerWrapper -> Batcher -> ParallelMapper
                       (processes, map-and-collate per batch) -> Prefetcher -> Loader
  litdata              litdata.optimize'd chunks, StreamingDataset + StreamingDataLoader
  streaming            MosaicML Streaming: MDSWriter shards, StreamingDataset(batch_size)
                       + StreamingDataLoader, persistent workers
  webdataset           .tar shards, WebDataset(shardshuffle).shuffle(1000).map().batched()
                       + WebLoader(batch_size=None), persistent workers
  dali                 (photo only) DALI's CPU pipeline, device_id=None: readers.file ->
                       decoders.image_random_crop -> resize -> crop_mirror_normalize
  ffcv                 (photo only) FFCV .beton (JPEG, full size) + its Loader with
                       RandomResizedCropRGBImageDecoder

Workloads (every loader gets the same samples and the same transform function):

  tiny   16 float32 + an int label per sample
  aug    3x72x72 uint8 images: random crop 64, flip, normalise (numpy)
  jpeg   96x96 JPEG files: decode (rt.data.decode_image, the same for every loader),
         random crop 80
  wds    WebDataset .tar shards of 3x32x32 raw uint8 images + .cls labels (litdata and
         streaming cannot read tar: not run there)
  photo  2,000 JPEGs cut from real photographs at ImageNet sizes (benchmarks/photos.py),
         repeated to 8,000 files in an ImageFolder tree: RandomResizedCrop(224) + flip.
         ringtrain: ImageFolder(decode=False, transform=DecodeCrop(224)); the others:
         decode_image (whole) + the same box sampling + the same antialiased resize

Rounds interleave the loaders (A B C A B C ..., --repeat rounds, default 3); each cell is
the median of its rounds, with the spread (lowest-highest samples/s); --hog runs a busy
process beside the whole benchmark. Per (workload, loader): samples/s over a
steady-state pass (after a warm-up pass),
time to first batch of a fresh loader, peak RSS per worker process (VmHWM), and the
time from a fresh loader restored to mid-epoch (load_state_dict) to its first batch.
Per workload, the ceiling: samples/s of as many processes as workers doing nothing but
the transform on samples in memory, all at once (photo: a second figure with processes
doing only DecodeCrop, ringtrain's transform). No loader can pass it, so each
loader's share of it shows how much is left, and ceiling / best other is the largest
ratio any loader could reach in that run.

    python benchmarks/loader_field.py [--quick] [--json FILE] [--workers 2]
    python benchmarks/loader_field.py --decoders     # JPEG decoders side by side
    python benchmarks/loader_field.py --crop-decoders   # photo decode + crop + resize ways
    python benchmarks/loader_field.py --memory 10000000   # ringtrain per-worker RSS, every format
"""

from __future__ import annotations

import argparse
import gc
import importlib
import io
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ringtrain.data import (  # noqa: E402
    DecodeCrop,
    ImageFolder,
    Loader,
    ParquetDataset,
    RecordShards,
    RecordWriter,
    TarShards,
    cpu_budget,
    decode_image,
)
from ringtrain.data.cropbox import draw_flip, random_resized_box  # noqa: E402
from ringtrain.data.decode import jpeg_decoders  # noqa: E402
from ringtrain.data.decodecrop import region_backend, resize_crop  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from photos import photo_jpegs  # noqa: E402

BATCH = 256
LOADERS = ("ringtrain", "torchdata_stateful", "torchdata_nodes", "litdata", "streaming",
           "webdataset", "dali", "ffcv")
WORKLOADS = ("tiny", "aug", "jpeg", "wds", "photo")
JPEG_POOL = 2000
PHOTO_SIZE = 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1) * 255
INV_STD = 1.0 / (np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1) * 255)


# ---- transforms (module level: every start method can pickle them) -----------------
def t_tiny(x: np.ndarray, y: int) -> tuple[np.ndarray, int]:
    return x, y


def t_aug(img: np.ndarray, y: int) -> tuple[np.ndarray, int]:
    top, left = np.random.randint(0, 9, 2)
    crop = img[:, top:top + 64, left:left + 64]
    if np.random.rand() < 0.5:
        crop = crop[:, :, ::-1]
    return (crop.astype(np.float32) - MEAN) * INV_STD, y


def t_jpeg(data: bytes, y: int) -> tuple[np.ndarray, int]:
    img = decode_image(data)
    top, left = np.random.randint(0, img.shape[0] - 79, 2)
    return np.ascontiguousarray(img[top:top + 80, left:left + 80].transpose(2, 0, 1)), y


def t_wds(raw: bytes, cls: bytes) -> tuple[np.ndarray, int]:
    return np.frombuffer(raw, dtype=np.uint8).reshape(3, 32, 32).copy(), int(cls)


def t_photo(data: bytes, y: int) -> tuple[np.ndarray, int]:
    """The others' pipeline for photos (torchvision v2's on a decoded uint8 image): whole
    decode (rt.data.decode_image), RandomResizedCrop's box and flip (the same sampler as
    DecodeCrop), the same antialiased resize (torch's uint8 kernel, what torchvision's
    RandomResizedCrop(antialias=True) calls). Only the decode differs from DecodeCrop."""
    img = decode_image(data)
    left, top, w, h = random_resized_box(img.shape[1], img.shape[0])
    flip = draw_flip(0.5)
    return resize_crop(img[top:top + h, left:left + w], PHOTO_SIZE, flip), y


_DECODE_CROP = DecodeCrop(PHOTO_SIZE)


def t_photo_decodecrop(data: bytes, y: int) -> tuple[np.ndarray, int]:
    """ringtrain's: rt.data.DecodeCrop (region decode where libturbojpeg 3 is found)."""
    return _DECODE_CROP(data), y


TRANSFORMS: dict[str, Callable[..., Any]] = {"tiny": t_tiny, "aug": t_aug, "jpeg": t_jpeg,
                                             "wds": t_wds, "photo": t_photo}


# ---- the data, in every format -------------------------------------------------------
def _jpeg(i: int, rng: np.random.Generator) -> bytes:
    from PIL import Image

    yy, xx = np.mgrid[0:96, 0:96]
    base = (np.sin(xx / (3 + i % 7)) + np.cos(yy / (4 + i % 5))) * 60 + 128
    img = np.stack([base, base[::-1], base[:, ::-1]], axis=-1)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


class Raw:
    """A workload's raw samples: ``raw(i) -> fields`` and the transform of the fields."""

    def __init__(self, name: str, n: int, pool_file: Path | None = None) -> None:
        self.name, self.n = name, n
        self._pool_file = pool_file
        rng = np.random.default_rng(0)
        self.y = rng.integers(0, 1000, n)
        self.x: np.ndarray[Any, Any]
        if name == "tiny":
            self.x = rng.standard_normal((n, 16), dtype=np.float32)
        elif name == "aug":
            self.x = rng.integers(0, 256, (n, 3, 72, 72), dtype=np.uint8)
        elif name == "jpeg":
            # Encoding costs ~1.4 ms a file here; decoding is the same work whatever
            # the pixels, so a pool of distinct files is repeated to the sample count.
            pool = self._pool(lambda: [_jpeg(i, rng) for i in range(min(n, JPEG_POOL))])
            self.jpegs = [pool[i % len(pool)] for i in range(n)]
        elif name == "photo":
            # 2,000 distinct JPEGs cut from real photographs (benchmarks/photos.py), the
            # pool repeated to the sample count as for jpeg.
            pool = self._pool(lambda: photo_jpegs(min(n, JPEG_POOL)))
            self.jpegs = [pool[i % len(pool)] for i in range(n)]
        else:
            self.x = rng.integers(0, 256, (n, 3 * 32 * 32), dtype=np.uint8)
        self.transform: Callable[..., Any] = TRANSFORMS[name]

    def _pool(self, make: Callable[[], list[bytes]]) -> list[bytes]:
        """The distinct files, made once and kept in ``pool_file`` for the cell processes."""
        import pickle
        if self._pool_file is not None and self._pool_file.exists():
            return list(pickle.loads(self._pool_file.read_bytes()))
        pool = make()
        if self._pool_file is not None:
            self._pool_file.parent.mkdir(parents=True, exist_ok=True)
            self._pool_file.write_bytes(pickle.dumps(pool))
        return pool

    def raw(self, i: int) -> tuple[Any, Any]:
        if self.name in ("jpeg", "photo"):
            return self.jpegs[i], int(self.y[i])
        if self.name == "wds":
            return self.x[i].tobytes(), str(int(self.y[i])).encode()
        return self.x[i], int(self.y[i])


class MapData:
    """Map-style: the raw samples in memory (tiny, aug) or files on disk (jpeg: ImageFolder)."""

    def __init__(self, raw: Raw) -> None:
        self.raw = raw

    def __len__(self) -> int:
        return self.raw.n

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.raw.transform(*self.raw.raw(i))


class FolderJpeg:
    """(jpeg, photo) an ImageFolder tree read as bytes, then the workload's transform."""

    def __init__(self, root: Path, transform: Callable[..., Any] = t_jpeg) -> None:
        self.folder = ImageFolder(root, decode=False)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        data, y = self.folder[i]
        return self.transform(data, y)


def write_folder(raw: Raw, root: Path) -> None:
    for i in range(raw.n):
        d = root / f"c{int(raw.y[i]) % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:07d}.jpg").write_bytes(raw.jpegs[i])


TAR_FIELD = {"tiny": "x", "aug": "img", "jpeg": "jpg", "wds": "bin", "photo": "jpg"}


def write_tars(raw: Raw, root: Path, shards: int) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    ext = TAR_FIELD[raw.name]
    paths = []
    per = -(-raw.n // shards)
    for s in range(shards):
        path = root / f"shard-{s:04d}.tar"
        with tarfile.open(path, "w") as tf:
            for i in range(s * per, min(raw.n, (s + 1) * per)):
                a, b = raw.raw(i)
                data_a = a if isinstance(a, bytes) else np.ascontiguousarray(a).tobytes()
                data_b = b if isinstance(b, bytes) else str(b).encode()
                for field, data in ((ext, data_a), ("cls", data_b)):
                    info = tarfile.TarInfo(f"{i:08d}.{field}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def _litdata_item(args: tuple[str, int]) -> Any:
    raw = _RAW[args[0]]
    a, b = raw.raw(args[1])
    return (a, b) if not isinstance(a, np.ndarray) else (np.ascontiguousarray(a), b)


_RAW: dict[str, Raw] = {}


def write_litdata(raw: Raw, root: Path) -> str:
    import litdata

    _RAW[raw.name] = raw
    out = str(root / f"litdata-{raw.name}")
    litdata.optimize(fn=_litdata_item, inputs=[(raw.name, i) for i in range(raw.n)],
                     output_dir=out, chunk_bytes="64MB", num_workers=1, verbose=False,
                     start_method="fork")
    return out


def write_mds(raw: Raw, root: Path) -> str:
    streaming = import_streaming()
    out = str(root / f"mds-{raw.name}")
    kind = {"tiny": "ndarray:float32:16", "aug": "ndarray:uint8:3,72,72",
            "jpeg": "bytes", "wds": "bytes", "photo": "bytes"}[raw.name]
    with streaming.MDSWriter(out=out, columns={"a": kind, "b": "int"}, size_limit=1 << 26) as w:
        for i in range(raw.n):
            a, b = raw.raw(i)
            w.write({"a": a, "b": int(b)})
    return out


def import_streaming() -> Any:
    """MosaicML Streaming imports torchvision for its vision datasets, and the
    torchvision wheels on PyPI for torch 2.13 are CUDA builds that do not load against
    torch's CPU build. Streaming's core does not use torchvision: give it a stub."""
    try:
        import streaming
        return streaming
    except (ImportError, RuntimeError):
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith(("torchvision.",
                                                                                  "streaming"))]:
            del sys.modules[name]
    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    datasets.VisionDataset = type("VisionDataset", (), {})  # type: ignore[attr-defined]
    datasets.CIFAR10 = type("CIFAR10", (), {})  # type: ignore[attr-defined]
    functional.to_tensor = lambda x: x  # type: ignore[attr-defined]
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": tv, "torchvision.datasets": datasets,
                        "torchvision.transforms": transforms,
                        "torchvision.transforms.functional": functional})
    import streaming
    return streaming


# ---- the loaders ---------------------------------------------------------------------
class StreamingTransform:
    """MosaicML Streaming / litdata sample -> the workload's transform."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, sample: Any) -> Any:
        t = TRANSFORMS[self.name]
        if isinstance(sample, dict):
            a, b = sample["a"], sample["b"]
            return t(a, b if self.name != "wds" else str(b).encode())
        a, b = sample
        return t(a, b)


def _streaming_dataset_class(streaming: Any) -> type:
    class Transformed(streaming.StreamingDataset):  # type: ignore[misc, name-defined]
        def __init__(self, *a: Any, name: str, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.tf = StreamingTransform(name)

        def __getitem__(self, i: int) -> Any:
            return self.tf(super().__getitem__(i))
    return Transformed


class WdsMap:
    """A tar sample (dict of fields as bytes) -> the workload's transform."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, sample: dict[str, Any]) -> Any:
        data, y = sample[TAR_FIELD[self.name]], sample["cls"]
        if self.name == "tiny":
            return t_tiny(np.frombuffer(data, dtype=np.float32).copy(), int(y))
        if self.name == "aug":
            return t_aug(np.frombuffer(data, dtype=np.uint8).reshape(3, 72, 72), int(y))
        if self.name in ("jpeg", "photo"):
            return TRANSFORMS[self.name](data, int(y))
        return t_wds(data, y)


def _dali_ok() -> bool:
    try:
        import nvidia.dali  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - not installed, or no library for this machine
        return False


class DaliPhotos:
    """DALI's CPU pipeline for the photo workload (``device_id=None``: no GPU):
    ``fn.readers.file`` (shuffled) -> ``fn.decoders.image_random_crop`` (decodes only
    the crop's region through libjpeg-turbo; RandomResizedCrop's area and aspect
    ranges, 10 attempts) -> ``fn.resize`` (antialiased linear, to 224x224) ->
    ``fn.crop_mirror_normalize`` (random mirror, CHW uint8), ``num_threads`` = workers.
    Resume through DALI's checkpointing (``enable_checkpointing``)."""

    def __init__(self, root: Path, n: int, workers: int, checkpoint: str | None = None) -> None:
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=BATCH, num_threads=workers, device_id=None, seed=0,
                      enable_checkpointing=True)
        def photos() -> Any:
            jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True,
                                            name="Reader")
            images = fn.decoders.image_random_crop(
                jpegs, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0],
                random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
            images = fn.resize(images, resize_x=PHOTO_SIZE, resize_y=PHOTO_SIZE, antialias=True)
            images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                              mirror=fn.random.coin_flip(probability=0.5))
            return images, labels

        self.root, self.n, self.w = root, n, workers
        self.pipe = photos(checkpoint=checkpoint) if checkpoint else photos()
        self.pipe.build()

    def __iter__(self) -> Any:
        for _ in range(-(-self.n // BATCH)):
            images, labels = self.pipe.run()
            yield images.as_array(), labels.as_array().reshape(-1)

    def state_dict(self) -> Any:
        return self.pipe.checkpoint()

    def load_state_dict(self, state: Any) -> None:
        self.pipe = DaliPhotos(self.root, self.n, self.w, checkpoint=state).pipe

    def close(self) -> None:
        del self.pipe


def write_ffcv(raw: Raw, root: Path) -> str:
    """The photos in FFCV's .beton, as JPEGs at full size (its ImageNet recipe stores them
    downscaled to a 256-pixel max side; here every loader reads the same photo sizes)."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    class Photos:
        def __len__(self) -> int:
            return raw.n

        def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
            data, y = raw.raw(i)
            return decode_image(data), int(y)

    out = str(root / "photos.beton")
    root.mkdir(parents=True, exist_ok=True)
    DatasetWriter(out, {"image": RGBImageField(write_mode="jpg", jpeg_quality=90),
                        "label": IntField()}, num_workers=1).from_indexed_dataset(Photos())
    return out


def ffcv_loader(path: str, workers: int) -> Any:
    """FFCV's ImageNet training pipeline: RandomResizedCropRGBImageDecoder (decodes the
    whole JPEG, then crops and resizes with OpenCV), a random flip, to CHW tensors."""
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader as FfcvLoader
    from ffcv.loader import OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    return FfcvLoader(path, batch_size=BATCH, num_workers=workers, order=OrderOption.RANDOM,
                      os_cache=True, drop_last=False, pipelines={
                          "image": [RandomResizedCropRGBImageDecoder((PHOTO_SIZE, PHOTO_SIZE)),
                                    RandomHorizontalFlip(), ToTensor(), ToTorchImage()],
                          "label": [IntDecoder(), ToTensor(), Squeeze()]})


class MapAndCollate:
    """torchdata.nodes' documented pattern: one process task per batch of indices."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> Any:
        from torch.utils.data import default_collate
        return default_collate([self.dataset[i] for i in indices])


class Bench:
    """Builds each loader for one workload; ``None`` where a loader cannot read it."""

    def __init__(self, raw: Raw, root: Path, workers: int, shards: int) -> None:
        self.raw, self.root, self.w, self.shards = raw, root, workers, shards
        self._made: dict[str, Any] = {}
        self._streaming_local = 0

    def _once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    def prepare(self, loader: str) -> bool:
        """Write the data in ``loader``'s format (not timed); False: it cannot read it."""
        name = self.raw.name
        if loader in ("litdata", "streaming", "torchdata_nodes") and name == "wds":
            return False  # they read their own formats (and Parquet), not tar
        if loader in ("dali", "ffcv") and name != "photo":
            return False  # run on the photo workload only (their image pipelines)
        if loader == "dali" and not _dali_ok():
            return False
        if loader == "ffcv":
            try:
                import ffcv  # noqa: F401
            except Exception:  # noqa: BLE001 - it needs OpenCV and libturbojpeg to build
                return False
            self._once("ffcv", lambda: write_ffcv(self.raw, self.root))
        if loader == "litdata":
            self._once("litdata", lambda: write_litdata(self.raw, self.root))
        elif loader == "streaming":
            self._once("mds", lambda: write_mds(self.raw, self.root))
        elif loader == "webdataset" or name == "wds":
            self.tars()
        elif name in ("jpeg", "photo"):
            self._once("folder", lambda: write_folder(self.raw, self.root / "folder"))
        return True

    def map_dataset(self, ours: bool = False) -> Any:
        name = self.raw.name
        if name == "jpeg":
            return FolderJpeg(self.root / "folder")
        if name == "photo":
            if ours:  # what the docs say to write: ImageFolder + DecodeCrop
                return ImageFolder(self.root / "folder", decode=False, transform=_DECODE_CROP)
            return FolderJpeg(self.root / "folder", t_photo)
        if name == "wds":
            return TarShards(self.tars(), sizes=self._tar_sizes(), transform=WdsMap("wds"))
        return MapData(self.raw)

    def tars(self) -> list[str]:
        return self._once("tars", lambda: write_tars(self.raw, self.root / "tars", self.shards))

    def _tar_sizes(self) -> list[int]:
        per = -(-self.raw.n // self.shards)  # as an index (wids) would list them
        return [max(0, min(self.raw.n, (s + 1) * per) - s * per) for s in range(self.shards)]

    def build(self, loader: str) -> Any:
        w, name = self.w, self.raw.name
        if loader == "ringtrain":
            return Loader(self.map_dataset(ours=True), batch_size=BATCH, num_workers=w,
                          device="cpu")
        if loader == "dali":
            return DaliPhotos(self.root / "folder", self.raw.n, w)
        if loader == "ffcv":
            return ffcv_loader(self._made["ffcv"], w)
        if loader == "torchdata_stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader
            if name == "wds":
                return StatefulDataLoader(self._wds_pipeline(), batch_size=None, num_workers=w,
                                          persistent_workers=True)
            return StatefulDataLoader(self.map_dataset(), batch_size=BATCH, shuffle=True,
                                      num_workers=w, persistent_workers=True)
        if loader == "torchdata_nodes":
            import torchdata.nodes as tn
            from torch.utils.data import RandomSampler
            ds = self.map_dataset()
            node: Any = tn.SamplerWrapper(RandomSampler(ds))
            node = tn.Batcher(node, batch_size=BATCH, drop_last=False)
            node = tn.ParallelMapper(node, map_fn=MapAndCollate(ds), num_workers=w,
                                     method="process", in_order=True)
            node = tn.Prefetcher(node, prefetch_factor=2 * w)
            return tn.Loader(node)
        if loader == "litdata":
            import litdata
            out = self._made["litdata"]
            ds = litdata.StreamingDataset(out, shuffle=True, transform=StreamingTransform(name))
            return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=w,
                                               persistent_workers=True)
        if loader == "streaming":
            streaming = import_streaming()
            from streaming.base.util import clean_stale_shared_memory
            clean_stale_shared_memory()
            out = self._made["mds"]
            self._streaming_local += 1
            cls = _streaming_dataset_class(streaming)
            ds = cls(local=out, shuffle=True, batch_size=BATCH, name=name)
            return streaming.StreamingDataLoader(ds, batch_size=BATCH, num_workers=w,
                                                 persistent_workers=True)
        if loader == "webdataset":
            import webdataset as wds
            return wds.WebLoader(self._wds_pipeline(), batch_size=None, num_workers=self.w,
                                 persistent_workers=True)
        raise ValueError(loader)

    def _wds_pipeline(self) -> Any:
        import webdataset as wds
        paths = self.tars()
        return (wds.WebDataset(paths, shardshuffle=len(paths), nodesplitter=wds.split_by_node,
                               empty_check=False)
                .shuffle(1000).map(WdsMap(self.raw.name)).batched(BATCH, partial=True))


# ---- measurement ---------------------------------------------------------------------
def _children() -> list[int]:
    """Descendant processes of this one (the loaders' workers and helpers)."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    me, out, frontier = os.getpid(), [], [os.getpid()]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c != me]
        out += kids
        frontier += kids
    return out


def _tree_cpu_s() -> float:
    """CPU seconds (user + system) so far of this process (all threads) and its live
    descendants (loader workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in [os.getpid(), *_children()]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def _hwm_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _count(batch: Any) -> int:
    labels = batch[1] if isinstance(batch, (tuple, list)) else batch["b"]
    return len(labels)


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    shutdown = getattr(loader, "shutdown", None)
    if callable(shutdown):
        shutdown()
    gc.collect()


def _state(loader: Any) -> Any:
    sd = getattr(loader, "state_dict", None)
    return sd() if callable(sd) else None


def measure(bench: Bench, loader: str, cap_s: float, skip: int = 2,
            warm_s: float | None = None, resume_batches: int = 60) -> dict[str, Any] | None:
    """One cell. The same protocol for every loader: a fresh loader's first batch, a
    warm-up pass, then a steady-state pass timed from its ``skip``-th batch (so a loader
    that restarts its workers per pass is not charged for it, and batches loaded ahead
    during the warm-up are used up first); a pass stops after an epoch or ``cap_s``
    seconds of timing (the warm-up after ``warm_s``), whichever comes first. Resume: a
    fresh loader, the same number of batches in (half an epoch, at most
    ``resume_batches``), its state, then the time from another fresh loader restored
    to that state to its first batch."""
    if not bench.prepare(loader):
        return None
    t0 = time.perf_counter()
    ld = bench.build(loader)
    it = iter(ld)
    next(it)
    first_s = time.perf_counter() - t0
    for _ in it:  # the rest of the warm-up pass
        if time.perf_counter() - t0 > (warm_s or cap_s):
            break
    del it
    if hasattr(ld, "set_epoch"):
        ld.set_epoch(1)
    samples, t1, k = 0, 0.0, 0
    cpu0 = time.process_time()
    for batch in ld:
        k += 1
        if k == skip:
            t1, cpu0 = time.perf_counter(), time.process_time()
            tree0 = _tree_cpu_s()
        elif k > skip:
            samples += _count(batch)
        if k > skip and time.perf_counter() - t1 > cap_s:
            break
    wall = time.perf_counter() - t1
    main_cpu = time.process_time() - cpu0
    tree_cpu = _tree_cpu_s() - tree0
    rss = [_hwm_mib(p) for p in _children()]
    _close(ld)
    del ld
    resume_s: float | None = None
    ld = bench.build(loader)
    if _state(ld) is not None or loader == "ringtrain":
        it = iter(ld)
        for _ in range(min(resume_batches, bench.raw.n // BATCH // 2)):
            next(it)
        state = _state(ld)
        del it
        _close(ld)
        del ld
        t2 = time.perf_counter()
        fresh = bench.build(loader)
        fresh.load_state_dict(state)
        next(iter(fresh))
        resume_s = time.perf_counter() - t2
        _close(fresh)
        del fresh
    else:
        _close(ld)
        del ld
    gc.collect()
    return {"samples_per_s": samples / wall, "first_batch_s": first_s, "resume_s": resume_s,
            "peak_rss_mib_per_worker": max(rss) if rss else None, "worker_processes": len(rss),
            "measured_samples": samples,
            "main_cpu_us_per_sample": main_cpu / max(1, samples) * 1e6,
            # CPU time of the whole loader (this process's threads + its workers) per
            # sample: what the loader costs, much less sensitive than samples/s to other
            # jobs on the machine (on an oversubscribed machine samples/s follows how
            # many runnable threads a loader has, not how little work it does)
            "cpu_ms_per_sample": tree_cpu / max(1, samples) * 1e3,
            "samples_per_cpu_s": samples / tree_cpu if tree_cpu > 0 else None}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "numpy": np.__version__}
    for mod, name in (("torchdata", "torchdata"), ("litdata", "litdata"),
                      ("nvidia.dali", "dali"), ("ffcv", "ffcv"),
                      ("webdataset", "webdataset"), ("simplejpeg", "simplejpeg"),
                      ("PIL", "pillow"), ("pyarrow", "pyarrow")):
        try:
            out[name] = getattr(importlib.import_module(mod), "__version__", "?")
        except Exception:
            out[name] = "not installed"
    out["DecodeCrop decoder"] = region_backend()
    try:
        out["mosaicml-streaming"] = import_streaming().__version__
    except Exception as err:  # noqa: BLE001
        out["mosaicml-streaming"] = f"not importable ({type(err).__name__})"
    return out


SETTINGS = {
    "ringtrain": "Loader(batch_size=256, num_workers=W, device='cpu'); defaults otherwise "
                 "(shuffle, zero-copy shared-memory slots, prefetch 4/worker); tiny, aug: "
                 "map-style in memory; jpeg: ImageFolder(decode=False) + the shared "
                 "transform; wds: TarShards(sizes from an index)",
    "torchdata_stateful": "StatefulDataLoader(batch_size=256, shuffle=True, num_workers=W, "
                          "persistent_workers=True, prefetch_factor=2); wds: over "
                          "webdataset's WebDataset pipeline, batch_size=None",
    "torchdata_nodes": "SamplerWrapper(RandomSampler) -> Batcher(256) -> ParallelMapper("
                       "map-and-collate per batch, num_workers=W, method='process', "
                       "in_order=True) -> Prefetcher(2W) -> Loader; not run on wds (no "
                       "tar reader)",
    "litdata": "optimize(chunk_bytes='64MB'); StreamingDataset(shuffle=True, transform=...) "
               "+ StreamingDataLoader(batch_size=256, num_workers=W, persistent_workers=True)",
    "streaming": "MDSWriter(size_limit=64MB); StreamingDataset(local, shuffle=True, "
                 "batch_size=256) + StreamingDataLoader(batch_size=256, num_workers=W, "
                 "persistent_workers=True)",
    "dali": "photo only: fn.readers.file(random_shuffle=True) -> fn.decoders.image_random_crop("
            "device='cpu', random_area=[0.08, 1], random_aspect_ratio=[3/4, 4/3], "
            "num_attempts=10) -> fn.resize(224x224, antialias=True) -> "
            "fn.crop_mirror_normalize(UINT8, CHW, mirror=coin_flip(0.5)); pipeline("
            "batch_size=256, num_threads=W, device_id=None, enable_checkpointing=True)",
    "ffcv": "photo only: DatasetWriter(RGBImageField(write_mode='jpg', jpeg_quality=90), full "
            "size) -> Loader(batch_size=256, num_workers=W, order=RANDOM, os_cache=True, "
            "pipelines: RandomResizedCropRGBImageDecoder((224, 224)), RandomHorizontalFlip, "
            "ToTensor, ToTorchImage); no resume",
    "webdataset": "tar shards of every workload; WebDataset(shardshuffle=#shards, "
                  "nodesplitter=split_by_node)"
                  ".shuffle(1000).map(...).batched(256) + WebLoader(batch_size=None, "
                  "num_workers=W, persistent_workers=True)",
}


def _transform_loop(raw: Raw, seconds: float, start: Any, out: Any,
                    transform: Callable[..., Any] | None) -> None:
    np.random.seed(os.getpid() % 2**32)
    torch.manual_seed(os.getpid())
    tf = transform or raw.transform
    n, i = 0, 0
    start.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        for _ in range(32):
            tf(*raw.raw(i % raw.n))
            i += 1
        n += 32
    out.put((n / (time.perf_counter() - t0), n / (time.process_time() - c0)))


def transform_ceiling(raw: Raw, workers: int, transform: Callable[..., Any] | None = None,
                      seconds: float = 2.0) -> float:
    """samples/s of ``workers`` processes doing, all at once, only the work every loader
    must do: the sample's fields from memory and the workload's transform (no reading,
    batching or transfer). No loader can beat it with as many workers on these cores,
    so it bounds every ratio in the table. (Measured in parallel, not as workers x one
    process's rate: on a VM two busy vCPUs run each other slower than one.)"""
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_transform_loop, args=(raw, seconds, start, out, transform))
             for _ in range(workers)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=60 + seconds) for _ in procs]
    for p in procs:
        p.join()
    CEILING_PER_CPU_S.append(float(np.mean([c for _, c in rates])))
    return float(sum(w for w, _ in rates))


#: samples per CPU-second of one ceiling process, per transform_ceiling call
CEILING_PER_CPU_S: list[float] = []


def _summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its rounds: the median of each figure, and the spread (lowest,
    highest) of samples/s."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[-1]
    out = dict(ok[-1])
    for key in ("samples_per_s", "first_batch_s", "resume_s", "peak_rss_mib_per_worker",
                "main_cpu_us_per_sample", "cpu_ms_per_sample", "samples_per_cpu_s"):
        vals = [r[key] for r in ok if r.get(key) is not None]
        out[key] = float(np.median(vals)) if vals else None
    rates = [r["samples_per_s"] for r in ok]
    out["samples_per_s_rounds"] = rates
    out["samples_per_s_spread"] = [min(rates), max(rates)]
    out["rounds"] = len(ok)
    if len(ok) < len(rounds):
        out["failed_rounds"] = [r["error"] for r in rounds if "error" in r]
    return out


SIZES = {"tiny": 400_000, "aug": 40_000, "jpeg": 40_000, "wds": 80_000, "photo": 8_000}


def _cell_args(name: str, quick: bool) -> dict[str, Any]:
    if name == "photo":
        # ~0.5 s a batch: time from batch 12 on, when every loader has used up what it
        # had loaded ahead (ringtrain 8 batches, the others 2-4), to the epoch's end
        # (at most 10 s); a 5 s warm-up pass; resume 8 batches in.
        return {"cap_s": 10.0, "skip": 12, "warm_s": 5.0,
                "resume_batches": 8}
    return {"cap_s": 3.0 if quick else 10.0}


def _open_bench(name: str, root: Path, workers: int, quick: bool) -> Bench:
    raw = Raw(name, int(SIZES[name] * (0.25 if quick else 1.0)), pool_file=root / "pool.pkl")
    return Bench(raw, root, workers, shards=16)


def _in_child(argv: list[str], timeout: float) -> Any:
    """Run one measurement in a fresh interpreter: each loader (and each ceiling) starts
    from a clean process, with no threads or workers of the loader measured before it
    (DALI's and FFCV's thread pools, a forked child's OpenMP state); the last line it
    prints is the result, as JSON."""
    import signal
    import subprocess
    proc = subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the cell and any worker it left behind
        out, err = proc.communicate()
        return {"error": f"no result within {timeout:.0f} s (killed)"}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # workers a loader did not stop
        except OSError:
            pass
    lines = [ln for ln in out.splitlines() if ln.startswith("CELL ")]
    if not lines:
        tail = (err or out).strip().splitlines()[-3:]
        return {"error": f"cell process exited {proc.returncode}: {' | '.join(tail)}"[:300]}
    return json.loads(lines[-1][5:])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    records: list[dict[str, Any]] = []
    loaders = args.loaders or list(LOADERS)
    common = ["--workers", str(args.workers)] + (["--quick"] if args.quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads or list(WORKLOADS):
            root = Path(tmp) / name
            bench = _open_bench(name, root, args.workers, args.quick)
            supported = []
            for loader in loaders:  # write every format once, untimed
                try:
                    if bench.prepare(loader):
                        supported.append(loader)
                except Exception as err:  # noqa: BLE001
                    print(f"  {name} {loader}: cannot prepare its data: {err}", flush=True)
            # tiny and aug with in-memory loaders only write no files of their own
            root.mkdir(parents=True, exist_ok=True)
            (root / "made.json").write_text(json.dumps(bench._made))
            raw = bench.raw
            rounds: dict[str, list[dict[str, Any]]] = {}
            ceilings: dict[str, list[float]] = {"transform": [], "decodecrop": []}
            per_cpu: dict[str, list[float]] = {"transform": [], "decodecrop": []}
            # Rounds interleave the loaders (A B C A B C ...): load from other jobs comes
            # and goes, and interleaving spreads it over every loader alike; the median of
            # the rounds is each loader's figure, the spread shows how much it moved.
            for _ in range(args.repeat):
                for kind in ("transform", "decodecrop") if name == "photo" else ("transform",):
                    got = _in_child(["--ceiling", name, kind, "--root", str(root), *common], 300)
                    if isinstance(got, list):
                        ceilings[kind].append(float(got[0]))
                        per_cpu[kind].append(float(got[1]))
                for loader in supported:
                    r = _in_child(["--cell", name, loader, "--root", str(root), *common], 240)
                    rounds.setdefault(loader, []).append(r)
            ceiling = float(np.median(ceilings["transform"])) if ceilings["transform"] else 0.0
            dc_ceiling = float(np.median(ceilings["decodecrop"])) if ceilings["decodecrop"] else None
            print(f"  {name:5s} the transform alone in {args.workers} processes: "
                  f"{ceiling:,.0f}/s (the ceiling, median of {args.repeat})"
                  + (f"; DecodeCrop alone: {dc_ceiling:,.0f}/s" if dc_ceiling else ""), flush=True)
            for loader in loaders:
                cell = (_summarise(rounds[loader]) if loader in rounds else
                        {"samples_per_s": None, "first_batch_s": None, "resume_s": None,
                         "note": "format not supported"})
                rec = {"workload": name, "loader": loader, "samples": raw.n,
                       "batch_size": BATCH, "workers": args.workers,
                       "ceiling_samples_per_s": ceiling,
                       "ceiling_rounds": ceilings["transform"], **cell}
                rec["ceiling_samples_per_cpu_s"] = (float(np.median(per_cpu["transform"]))
                                                    if per_cpu["transform"] else None)
                if dc_ceiling is not None:
                    rec["decodecrop_ceiling_samples_per_s"] = dc_ceiling
                    rec["decodecrop_ceiling_rounds"] = ceilings["decodecrop"]
                    rec["decodecrop_ceiling_samples_per_cpu_s"] = float(np.median(
                        per_cpu["decodecrop"]))
                records.append(rec)
                print(_line(rec), flush=True)
            shutil.rmtree(root, ignore_errors=True)
    return records


def cell_main(args: argparse.Namespace) -> int:
    """One measurement in this (fresh) process: ``--cell WORKLOAD LOADER`` or
    ``--ceiling WORKLOAD transform|decodecrop``, over the data the parent wrote."""
    torch.set_num_threads(1)
    name = (args.cell or args.ceiling)[0]
    bench = _open_bench(name, args.root, args.workers, args.quick)
    bench._made = json.loads((args.root / "made.json").read_text())
    if args.ceiling:
        kind = args.ceiling[1]
        tf = t_photo_decodecrop if kind == "decodecrop" else None
        secs = 5.0 if name == "photo" else 2.0
        wall = transform_ceiling(bench.raw, args.workers, tf, seconds=secs)
        print("CELL " + json.dumps([wall, CEILING_PER_CPU_S[-1]]))
        return 0
    try:
        r = measure(bench, args.cell[1], **_cell_args(name, args.quick))
    except Exception as err:  # noqa: BLE001 - report it as the cell's result
        r = {"error": f"{type(err).__name__}: {err}"[:300]}
    print("CELL " + json.dumps(r), flush=True)
    # torchdata.nodes' process workers kept the interpreter from exiting (measured: a
    # cell past 600 s after its result); the parent kills what is left
    os._exit(0)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {r['workload']:5s} {r['loader']:19s} ERROR {r['error']}"
    spread = r.get("samples_per_s_spread")
    return (f"  {r['workload']:5s} {r['loader']:19s} {_fmt(r['samples_per_s'], ',.0f'):>10s}/s"
            + (f" ({spread[0]:,.0f}-{spread[1]:,.0f})" if spread else "")
            + f"  first {_fmt(r['first_batch_s'], '.2f'):>5s} s  resume "
            f"{_fmt(r['resume_s'], '.2f'):>5s} s  rss/worker "
            f"{_fmt(r.get('peak_rss_mib_per_worker'), '.0f'):>5s} MiB  "
            f"{_fmt(_share(r), '.2f')} of the ceiling  "
            f"{_fmt(r.get('cpu_ms_per_sample'), '.2f')} CPU ms/sample")


def _share(r: dict[str, Any]) -> float | None:
    """samples/s as a share of the transform-bound ceiling (see transform_ceiling)."""
    if not r.get("samples_per_s") or not r.get("ceiling_samples_per_s"):
        return None
    return float(r["samples_per_s"] / r["ceiling_samples_per_s"])


def targets(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in WORKLOADS:
        rows = [r for r in records if r["workload"] == name and r.get("samples_per_s")]
        ours = next((r for r in rows if r["loader"] == "ringtrain"), None)
        others = [r for r in rows if r["loader"] != "ringtrain"]
        if ours is None or not others:
            continue
        best = max(others, key=lambda r: r["samples_per_s"])
        want = {"tiny": 2.0, "photo": 1.25}.get(name, 1.5)
        ratio = ours["samples_per_s"] / best["samples_per_s"]
        fb = min(r["first_batch_s"] for r in others)
        resumes = [r["resume_s"] for r in others if r.get("resume_s") is not None]
        out[name] = {
            "throughput_vs_best": ratio, "best_other": best["loader"], "target": want,
            "throughput_met": ratio >= want,
            "first_batch_s": ours["first_batch_s"], "best_other_first_batch_s": fb,
            "first_batch_met": ours["first_batch_s"] <= fb,
            "resume_s": ours["resume_s"],
            "best_other_resume_s": min(resumes) if resumes else None,
            "resume_met": (not resumes or ours["resume_s"] <= min(resumes)),
            "share_of_ceiling": _share(ours), "best_other_share_of_ceiling": _share(best),
            # The most any loader could be ahead of the best other one in this run: a
            # target above it cannot be met at this worker count with this transform.
            "reachable_vs_best": (ours.get("decodecrop_ceiling_samples_per_s",
                                           ours["ceiling_samples_per_s"]) / best["samples_per_s"]
                                  if ours.get("ceiling_samples_per_s") else None),
        }
        effs = [r["samples_per_cpu_s"] for r in others if r.get("samples_per_cpu_s")]
        if ours.get("samples_per_cpu_s") and effs:
            # samples per CPU-second of the whole loader, ours over the most frugal other
            out[name]["cpu_efficiency_vs_best"] = ours["samples_per_cpu_s"] / max(effs)
        if ours.get("decodecrop_ceiling_samples_per_s"):
            # ringtrain's transform is DecodeCrop: its own ceiling is the second figure
            out[name]["share_of_ceiling"] = (ours["samples_per_s"]
                                             / ours["decodecrop_ceiling_samples_per_s"])
    return out


# ---- decoders ------------------------------------------------------------------------
def decoders(n: int) -> dict[str, Any]:
    from PIL import Image
    tv, tv_status = _torchvision_io()
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for side in (96, 256, 512):
        yy, xx = np.mgrid[0:side, 0:side]
        base = (np.sin(xx / 5) + np.cos(yy / 7)) * 60 + 128
        img = np.clip(np.stack([base, base[::-1], base[:, ::-1]], -1)
                      + rng.normal(0, 12, (side, side, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
        calls: dict[str, Callable[[], Any]] = {
            dec: partial(decode_image, data, decoder=dec) for dec in jpeg_decoders()}
        if tv is not None:  # HWC RGB from the others, CHW from torchvision: the same decode
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            calls["torchvision"] = partial(tv.decode_jpeg, raw, mode=tv.ImageReadMode.RGB)
            if torch.cuda.is_available():  # nvJPEG, 64 images per call as users batch it
                calls["torchvision_cuda_per_image"] = partial(_gpu_decode, tv, [raw] * 64)
        row = {dec: float("inf") for dec in calls}
        count = max(20, n * 96 * 96 // (side * side))
        for _ in range(9):  # rounds interleave the decoders; best of 9: load only slows
            for dec, call in calls.items():
                t = time.perf_counter()
                for _ in range(count):
                    call()
                per_call = (time.perf_counter() - t) / count * 1e6
                row[dec] = min(row[dec], per_call / (64 if dec.endswith("per_image") else 1))
        out[f"{side}x{side}"] = row
        print(f"  jpeg {side}x{side}: " + ", ".join(f"{k} {v:.0f} us" for k, v in row.items())
              + (f"  (pillow / simplejpeg = {row['pillow'] / row['simplejpeg']:.2f}x)"
                 if "simplejpeg" in row else ""), flush=True)
    out["torchvision"] = tv_status
    print(f"  torchvision.io.decode_jpeg: {tv_status}")
    return out


def _gpu_decode(tv: Any, raws: list[torch.Tensor]) -> None:
    """Decode on the GPU and wait for it; timed per call, so per image is / len(raws)."""
    tv.decode_jpeg(raws, mode=tv.ImageReadMode.RGB, device="cuda")
    torch.cuda.synchronize()


def _torchvision_io() -> tuple[Any, str]:
    """torchvision.io where it loads (PyPI's torchvision wheels for torch 2.13 are CUDA
    builds that do not load against torch's CPU build; a torch 2.14.1 + torchvision
    0.29.1 environment runs them on the CPU)."""
    try:
        import torchvision
        import torchvision.io as tv
        return tv, f"timed (torchvision {torchvision.__version__}, torch {torch.__version__})"
    except Exception as err:  # noqa: BLE001
        return None, f"not usable here: {type(err).__name__}: {err}"[:200]


# ---- decode + crop on photos: the candidates behind DecodeCrop's choices ---------------
def crop_decoders(n: int, rounds: int = 5) -> dict[str, Any]:
    """us per sample and quality of each way to turn a photo JPEG + a RandomResizedCrop
    box into a 224x224 crop, one process, the same files and boxes for all; rounds
    interleave the candidates, medians kept. Quality: mean absolute difference (0-255)
    per image against whole decode + crop + Pillow BILINEAR (the issue's reference)."""
    import math

    from PIL import Image

    from ringtrain.data import turbojpeg
    from ringtrain.data.jpeginfo import image_info

    torch.set_num_threads(1)
    files = photo_jpegs(n, seed=1)
    torch.manual_seed(0)
    infos = [image_info(f) for f in files]
    boxes = [random_resized_box(i.width, i.height) for i in infos]
    tj = turbojpeg.load()
    dc = DecodeCrop(PHOTO_SIZE, flip=0.0)
    size = PHOTO_SIZE

    def pil_out(img: Any) -> np.ndarray:
        return np.asarray(img).transpose(2, 0, 1)

    def reference(f: bytes, b: Any, info: Any) -> np.ndarray:
        left, top, w, h = b
        crop = np.ascontiguousarray(decode_image(f)[top:top + h, left:left + w])
        return pil_out(Image.fromarray(crop).resize((size, size), Image.Resampling.BILINEAR))

    def whole_torch(f: bytes, b: Any, info: Any) -> np.ndarray:
        left, top, w, h = b
        return resize_crop(decode_image(f)[top:top + h, left:left + w], size, False)

    def whole_opencv_area(f: bytes, b: Any, info: Any) -> np.ndarray:
        import cv2
        left, top, w, h = b
        crop = decode_image(f)[top:top + h, left:left + w]
        return cv2.resize(crop, (size, size), interpolation=cv2.INTER_AREA).transpose(2, 0, 1)

    def pillow_draft(f: bytes, b: Any, info: Any) -> np.ndarray:
        left, top, w, h = b
        img = Image.open(io.BytesIO(f))
        img.draft("RGB", (math.ceil(info.width * size / min(w, h)),
                          math.ceil(info.height * size / min(w, h))))
        fx, fy = img.size[0] / info.width, img.size[1] / info.height
        return pil_out(img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR, box=(
            left * fx, top * fy, (left + w) * fx, (top + h) * fy)))

    def simplejpeg_scaled(f: bytes, b: Any, info: Any) -> np.ndarray:
        import simplejpeg
        left, top, w, h = b
        m = max(1, min(8, math.ceil(8 * size / min(w, h))))
        img = simplejpeg.decode_jpeg(f, min_width=math.ceil(info.width * m / 8),
                                     min_height=math.ceil(info.height * m / 8))
        fx, fy = img.shape[1] / info.width, img.shape[0] / info.height
        return pil_out(Image.fromarray(img).resize((size, size), Image.Resampling.BILINEAR, box=(
            left * fx, top * fy, (left + w) * fx, (top + h) * fy)))

    def region_torch(f: bytes, b: Any, info: Any) -> np.ndarray:
        return dc.apply(f, b)

    def region_scaled_1x(f: bytes, b: Any, info: Any) -> np.ndarray:
        # DCT scaling down to just above the output (M/8, M = 1..8), then Pillow's
        # fractional-box resize: what DecodeCrop does only from 2x the output
        assert tj is not None
        left, top, w, h = b
        m = max(1, min(8, math.ceil(8 * size / min(w, h))))
        if m == 8 or not info.region:
            return dc.apply(f, b)
        return dc._scaled(tj, f, info, b, m, False)

    cands: dict[str, Callable[[bytes, Any, Any], np.ndarray]] = {
        "whole + crop + Pillow BILINEAR (reference)": reference,
        "whole + crop + torch antialias (the others' pipeline)": whole_torch,
        "whole + crop + OpenCV INTER_AREA": whole_opencv_area,
        "Pillow draft + resize(box)": pillow_draft,
        "simplejpeg min_width/height + Pillow resize(box)": simplejpeg_scaled,
    }
    if tj is not None:
        cands["DecodeCrop: region + torch antialias"] = region_torch
        cands["region + DCT scale to >= 1x + Pillow resize(box)"] = region_scaled_1x
    times: dict[str, list[float]] = {k: [] for k in cands}
    outs: dict[str, list[np.ndarray]] = {}
    for _ in range(rounds):
        for name, fn in cands.items():
            try:
                t = time.perf_counter()
                outs[name] = [fn(f, b, i) for f, b, i in zip(files, boxes, infos, strict=True)]
                times[name].append((time.perf_counter() - t) / n * 1e6)
            except Exception as err:  # noqa: BLE001 - e.g. OpenCV not installed
                times[name] = []
                outs[name] = []
                print(f"  {name}: {type(err).__name__}: {err}")
    ref = outs["whole + crop + Pillow BILINEAR (reference)"]
    out: dict[str, Any] = {"files": n, "rounds": rounds, "decoder": region_backend()}
    base = statistics.median(times["whole + crop + torch antialias (the others' pipeline)"])
    for name in cands:
        if not times[name]:
            continue
        mads = [float(np.abs(a.astype(np.int16) - r).mean()) for a, r in zip(outs[name], ref, strict=True)]
        med = statistics.median(times[name])
        out[name] = {"us_per_sample": med, "spread": [min(times[name]), max(times[name])],
                     "speed_vs_whole_torch": base / med, "mad_mean": statistics.mean(mads),
                     "mad_max": max(mads)}
        print(f"  {name:55s} {med:6.0f} us ({min(times[name]):.0f}-{max(times[name]):.0f})  "
              f"{base / med:4.2f}x  MAD mean {statistics.mean(mads):.2f} max {max(mads):.2f}",
              flush=True)
    return out


# ---- memory over a long epoch (ringtrain, every format) ------------------------------
def _uss_mib(pid: int) -> float:
    total = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    except OSError:
        return 0.0
    return total / 1024


def memory(samples: int, workers: int, only: str | None = None) -> dict[str, Any]:
    """Per-worker private memory at 10% and at the end of ``samples`` samples
    (``only="photo"``: just the photo folder through DecodeCrop)."""
    out: dict[str, Any] = {"samples": samples}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n_tar = min(samples, 500_000)  # 1 GB of tar (2 members of >= 1 KiB per sample)
        formats: dict[str, Callable[[], Any]] = {
            "map-style (tiny, numpy arrays)": lambda: MapData(Raw("tiny", samples)),
        }

        def photos() -> Any:
            # 2,000 photo files, read over and over: the epoch is the sample count
            raw = Raw("photo", JPEG_POOL)
            write_folder(raw, root / "photos")
            folder = ImageFolder(root / "photos", decode=False, transform=_DECODE_CROP)
            return _Repeat(folder, samples)

        if only == "photo":
            formats = {"ImageFolder + DecodeCrop (2,000 photos, repeated)": photos}

        def records() -> Any:
            with RecordWriter(root / "rec", shard_records=500_000) as w:
                x = np.random.default_rng(0).standard_normal((samples, 16), dtype=np.float32)
                for i in range(samples):
                    w.write(x[i].tobytes())
            return RecordShards(root / "rec", transform=_rec_sample)

        def parquet() -> Any:
            import pyarrow as pa
            import pyarrow.parquet as pq
            x = np.random.default_rng(0).standard_normal((samples, 16), dtype=np.float32)
            pq.write_table(pa.table({
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 16),
                "y": pa.array(np.arange(samples) % 1000)}), root / "t.parquet",
                row_group_size=100_000)
            return ParquetDataset(str(root / "t.parquet"), transform=_pq_sample)

        def tars() -> Any:
            paths = write_tars(Raw("tiny", n_tar), root / "tars", shards=max(1, n_tar // 20_000))
            return TarShards(paths, transform=WdsMap("tiny"))

        if only != "photo":
            formats["RecordShards"] = records
            formats["ParquetDataset"] = parquet
            formats[f"TarShards ({n_tar:,} samples, read {samples // n_tar}x)"] = tars
        for label, make in formats.items():
            ds = make()
            loader = Loader(ds, batch_size=BATCH, num_workers=workers, device="cpu")
            seen, marks = 0, {}
            t0 = time.perf_counter()
            while seen < samples:
                for batch in loader:
                    seen += _count(batch)
                    if "early" not in marks and seen >= samples // 10:
                        marks["early"] = [_uss_mib(p) for p in loader.worker_pids]
                    if "half" not in marks and seen >= samples // 2:
                        marks["half"] = [_uss_mib(p) for p in loader.worker_pids]
                    if seen >= samples:
                        break
            marks["end"] = [_uss_mib(p) for p in loader.worker_pids]
            out[label] = {"uss_mib_at_10pct": marks["early"], "uss_mib_at_50pct": marks["half"],
                          "uss_mib_at_end": marks["end"],
                          "growth_mib": [b - a for a, b in zip(marks["early"], marks["end"], strict=False)],
                          "samples_per_s": seen / (time.perf_counter() - t0)}
            print(f"  memory {label:42s} {json.dumps(out[label])}", flush=True)
            loader.close()
            del ds, loader
            gc.collect()
    return out


class _Repeat:
    """A map-style dataset ``n`` samples long over a smaller one (index modulo its length)."""

    def __init__(self, ds: Any, n: int) -> None:
        self.ds, self.n = ds, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.ds[i % len(self.ds)]


def _rec_sample(b: bytes) -> tuple[np.ndarray, int]:
    return np.frombuffer(b, dtype=np.float32), len(b)


def _pq_sample(row: dict[str, Any]) -> tuple[np.ndarray, int]:
    return row["x"], int(row["y"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the data, one run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=None,
                        help="interleaved rounds per cell, median kept (default 3)")
    parser.add_argument("--hog", action="store_true",
                        help="run a CPU hog (one busy process) beside the whole benchmark")
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    parser.add_argument("--loaders", nargs="*", choices=LOADERS)
    parser.add_argument("--workloads", nargs="*", choices=WORKLOADS)
    parser.add_argument("--decoders", action="store_true", help="only time the JPEG decoders")
    parser.add_argument("--crop-decoders", action="store_true",
                        help="only time the ways to decode + crop + resize a photo")
    parser.add_argument("--memory", type=int, default=0, metavar="N",
                        help="only measure ringtrain's per-worker memory over N samples")
    parser.add_argument("--cell", nargs=2, metavar=("WORKLOAD", "LOADER"), help=argparse.SUPPRESS)
    parser.add_argument("--ceiling", nargs=2, metavar=("WORKLOAD", "KIND"), help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--memory-photo", action="store_true",
                        help="with --memory: only the photo folder through DecodeCrop")
    args = parser.parse_args(argv)
    # torch's collate warns about read-only numpy arrays (the competitors' mmapped
    # samples), once per worker: noise in the table.
    warnings.filterwarnings("ignore")
    if args.repeat is None:
        args.repeat = 3
    if args.cell or args.ceiling:
        return cell_main(args)
    hog = _start_hog() if args.hog else None
    try:
        return _main(args)
    finally:
        if hog is not None:
            hog.terminate()
            hog.join()


def _spin() -> None:
    while True:
        pass


def _start_hog() -> Any:
    """One process spinning on a core for the whole run: the busy machine of CI."""
    proc = multiprocessing.get_context("fork").Process(target=_spin, daemon=True)
    proc.start()
    print(f"CPU hog: pid {proc.pid} spins beside the benchmark", flush=True)
    return proc


def _main(args: argparse.Namespace) -> int:
    budget = cpu_budget()
    print(f"{budget.describe()}; batch {BATCH}; {args.workers} workers; load average "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    if args.decoders:
        doc: Any = {"decoders": decoders(400)}
    elif args.crop_decoders:
        doc = {"crop_decoders": crop_decoders(300)}
    elif args.memory:
        doc = {"memory": memory(args.memory, args.workers,
                                "photo" if args.memory_photo else None)}
    else:
        vers = versions()
        print("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()), flush=True)
        records = run(args)
        summary = targets(records)
        print("\ntarget (ringtrain vs the best other)   value    target  met")
        for name, t in summary.items():
            print(f"{name:5s} samples/s vs {t['best_other']:19s} {t['throughput_vs_best']:5.2f}x"
                  f"  {t['target']:g}x    {'yes' if t['throughput_met'] else 'NO'}")
            if t["reachable_vs_best"] is not None:
                print(f"{name:5s} share of the ceiling {t['share_of_ceiling']:.2f} vs "
                      f"{t['best_other_share_of_ceiling']:.2f}: at most "
                      f"{t['reachable_vs_best']:.2f}x was reachable"
                      + ("" if t["reachable_vs_best"] >= t["target"] else
                         f" (below the {t['target']:g}x target: no loader can meet it "
                         "with this transform on these cores)"))
            if t.get("cpu_efficiency_vs_best"):
                print(f"{name:5s} samples per CPU-second vs the most frugal other: "
                      f"{t['cpu_efficiency_vs_best']:.2f}x")
            print(f"{name:5s} first batch {t['first_batch_s']:.2f} s vs "
                  f"{t['best_other_first_batch_s']:.2f} s            "
                  f"{'yes' if t['first_batch_met'] else 'NO'}")
            if t["best_other_resume_s"] is not None:
                print(f"{name:5s} resume {t['resume_s']:.2f} s vs {t['best_other_resume_s']:.2f} s"
                      f"                 {'yes' if t['resume_met'] else 'NO'}")
        doc = records
        if args.json:
            for r in records:
                r["settings"] = SETTINGS[r["loader"]]
                r["version"] = vers.get(r["loader"].split("_")[0].replace(
                    "streaming", "mosaicml-streaming"), vers["torch"])
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
