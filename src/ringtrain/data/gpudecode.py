"""GPU decode for ``DecodeCrop(device="cuda")``: workers hand over files and boxes, the
GPU decodes, crops and resizes the batch.

On a 2-core host the CPU cannot decode photos as fast as one GPU trains on them (a
ResNet-50 on an A100 takes ~2,500 images/s, two cores decode ~800 crops/s); nvJPEG
can. The path::

    worker:   box, flip = DecodeCrop.sample(header)       (cheap: no decode)
              sample = the file's bytes + box + flip      (encode_sample)
    worker:   collate: one flat byte array + offsets + boxes + flips  (collate_encoded)
    loader:   on its side stream, ahead of the loop (the same stream that copies
              batches; ringtrain.data.prefetch):
              torchvision.io.decode_jpeg(list of files, device="cuda")   (nvJPEG, batched;
                  the side stream drained first: see decode_jpegs)
              per image: crop the box, antialiased bilinear resize, flip
    loop:     images (B x 3 x size x size uint8, on the GPU) + the other fields

The slot holding the files is released only once the side stream has passed the
decode (its event), as for copies. Files nvJPEG should not get (PNG, CMYK,
progressive, arithmetic-coded) are decoded and cropped by the worker on the CPU and
travel as pixels. The decode function is a module attribute (``decode_jpegs``) so that
tests run the whole path on the CPU (tests/unit/data/test_data_gpudecode.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ringtrain.data.collate import default_collate
from ringtrain.data.jpeginfo import ImageInfo
from ringtrain.errors import DataError

__all__ = ["Encoded", "GpuDecodeCollate", "encode_sample", "collate_encoded", "decode_jpegs",
           "ENCODED_KEY"]

#: Marks the encoded part of a batch (a dict) for the device stage.
ENCODED_KEY = "__decodecrop__"


class Encoded:
    """One sample on its way to the GPU: the file and its box and flip, or (a file nvJPEG
    should not get) the finished crop as pixels."""

    __slots__ = ("data", "box", "flip", "pixels")

    def __init__(self, data: bytes, box: tuple[int, int, int, int], flip: bool,
                 pixels: np.ndarray | None = None) -> None:
        self.data, self.box, self.flip, self.pixels = data, box, flip, pixels


def encode_sample(crop: Any, data: bytes, info: ImageInfo, box: tuple[int, int, int, int],
                  flip: bool) -> Encoded:
    """What a worker hands over for ``DecodeCrop(device="cuda")``."""
    if info.jpeg and info.region:
        return Encoded(data, box, flip)
    return Encoded(b"", box, flip, crop._apply(data, info, box, flip))


def _pack(crop: Any, items: list[Encoded]) -> dict[str, Any]:
    n = len(items)
    lengths = np.fromiter((len(e.data) for e in items), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    files = np.empty(int(offsets[-1]), dtype=np.uint8)
    for e, start in zip(items, offsets[:-1].tolist(), strict=True):
        files[start:start + len(e.data)] = np.frombuffer(e.data, dtype=np.uint8)
    ready = [i for i, e in enumerate(items) if e.pixels is not None]
    pixels = (np.stack([items[i].pixels for i in ready]) if ready  # type: ignore[misc]
              else np.zeros((0, 3, crop.size, crop.size), dtype=np.uint8))
    return {ENCODED_KEY: np.array([crop.size], dtype=np.int64), "files": files,
            "offsets": offsets,
            "boxes": np.array([e.box for e in items], dtype=np.int64).reshape(n, 4),
            "flips": np.array([e.flip for e in items], dtype=np.bool_),
            "ready": np.array(ready, dtype=np.int64), "pixels": pixels}


def collate_encoded(crop: Any, samples: list[Any]) -> Any:
    """A batch of :class:`Encoded` samples (or tuples whose first field is one, as
    ``ImageFolder`` gives: then a list of fields, as the default collate gives): the
    files packed into one byte array, the other fields collated as usual."""
    first = samples[0]
    if isinstance(first, Encoded):
        return _pack(crop, samples)
    if isinstance(first, tuple) and first and isinstance(first[0], Encoded):
        # a list of fields, as the default collate makes of tuple samples (DataLoader's)
        rest = default_collate([s[1:] for s in samples])
        return [_pack(crop, [s[0] for s in samples]), *rest]
    raise DataError("DecodeCrop(device='cuda').collate needs samples that are DecodeCrop's "
                    f"output (or tuples starting with it), got {type(first).__name__}; use it "
                    "as the dataset's transform")


def decode_jpegs(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """JPEG files (CPU uint8 tensors) -> ``3 x H x W`` uint8 images on ``device``, with
    nvJPEG through torchvision (batched: one call for the batch)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as err:  # ImportError, or a torchvision built for another torch
        raise DataError(f"DecodeCrop(device='cuda') needs torchvision with nvJPEG "
                        f"(torchvision.io.decode_jpeg): {type(err).__name__}: {err}") from None
    if device.type == "cuda":
        # torchvision allocates the images on the current stream (the loader's side
        # stream) but nvJPEG writes them on a private stream that never waits for the
        # current one (nor does nvJPEG's hardware decoder honour stream order), while
        # the caching allocator hands out a block as soon as it is freed on its stream:
        # the previous batch's decoded images and resize buffers, freed while that
        # batch's crop kernels are still queued, could be overwritten under those kernels
        # (pytorch/vision#9606). Drain the stream first: every block it can hand out is
        # then idle.
        torch.cuda.current_stream(device).synchronize()
    return list(decode_jpeg(files, mode=ImageReadMode.RGB, device=device))


def _crop_resize(img: torch.Tensor, box: list[int], size: int, flip: bool) -> torch.Tensor:
    left, top, w, h = box
    x = img[:, top:top + h, left:left + w].unsqueeze(0).float()
    # CUDA's antialiased kernels take floating point; round as the uint8 CPU kernel does.
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    out = x[0].round_().clamp_(0, 255).to(torch.uint8)
    return out.flip(-1) if flip else out


def decode_encoded(enc: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The images of an encoded batch (see :func:`collate_encoded`), on ``device``."""
    size = int(enc[ENCODED_KEY][0])
    offsets = enc["offsets"].tolist()
    boxes = enc["boxes"].tolist()
    flips = enc["flips"].tolist()
    ready = set(enc["ready"].tolist())
    files = torch.as_tensor(enc["files"])
    n = len(offsets) - 1
    out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=device)
    todo = [i for i in range(n) if i not in ready]
    if todo:
        images = decode_jpegs([files[offsets[i]:offsets[i + 1]] for i in todo], device)
        for i, img in zip(todo, images, strict=True):
            out[i] = _crop_resize(img, boxes[i], size, flips[i])
    if ready:
        index = torch.as_tensor(enc["ready"]).to(device)
        out[index] = torch.as_tensor(enc["pixels"]).to(device, non_blocking=True)
    return out


def _finish(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict) and ENCODED_KEY in batch:
        return decode_encoded(batch, device)
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return torch.as_tensor(batch).to(device, non_blocking=True)
    if isinstance(batch, tuple):
        return tuple(_finish(v, device) for v in batch)
    if isinstance(batch, list):
        return [_finish(v, device) for v in batch]
    if isinstance(batch, dict):
        return {k: _finish(v, device) for k, v in batch.items()}
    return batch


class GpuDecodeCollate:
    """``DecodeCrop(device="cuda").collate``: the loader's ``collate_fn`` (runs in the
    workers) and, as ``on_device``, the stage the loader runs on its side stream."""

    def __init__(self, crop: Any) -> None:
        self.crop = crop

    def __call__(self, samples: list[Any]) -> Any:
        return collate_encoded(self.crop, samples)

    def on_device(self, batch: Any, device: torch.device) -> Any:
        """Decode the batch's files on ``device``; other fields are copied there."""
        return _finish(batch, device)


#: What the loader calls on the side stream: ``fn(host batch, device) -> device batch``.
DeviceStage = Callable[[Any, torch.device], Any]
