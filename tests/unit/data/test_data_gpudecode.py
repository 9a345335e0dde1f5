"""DecodeCrop(device="cuda") on the CPU: workers hand over files and boxes, the loader's
device stage decodes them (nvJPEG replaced by a CPU decoder), on the stager through
the fake CUDA backend of tests/fake_cuda.py."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fake_cuda import FakeBackend

import ringtrain as rt
from ringtrain.data import gpudecode
from ringtrain.data import loader as loader_mod
from ringtrain.data.gpudecode import Encoded
from ringtrain.errors import DataError

Image = pytest.importorskip("PIL.Image")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from photos import photo_jpegs  # noqa: E402


class RunBackend(FakeBackend):
    """The fake device, plus the device stage: ``fn`` reads the host batch at once (as
    nvJPEG's host-side parse does); the slot must still wait for the event."""

    def __init__(self) -> None:
        super().__init__(lag=2)
        self.events: list[Any] = []

    def run(self, fn: Any, host: Any) -> tuple[Any, Any, Any]:
        from fake_cuda import FakeEvent
        ev = FakeEvent([])
        self.events.append(ev)
        return fn(host, torch.device("cpu")), ev, ev


@pytest.fixture()
def cpu_nvjpeg(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """nvJPEG stand-in: decodes the files on the CPU; counts calls (one per batch)."""
    calls: list[int] = []

    def decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        calls.append(len(files))
        return [torch.from_numpy(rt.data.decode_image(f.numpy().tobytes())).permute(2, 0, 1)
                for f in files]
    monkeypatch.setattr(gpudecode, "decode_jpegs", decode)
    return calls


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    try:
        return photo_jpegs(10, seed=11)
    except RuntimeError as err:  # neither scikit-learn nor matplotlib (both in the dev extra)
        pytest.skip(str(err))


def _png(data: bytes) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buf, format="PNG")
    return buf.getvalue()


def test_workers_hand_over_files_and_pngs_as_pixels(photos: list[bytes]) -> None:
    crop = rt.data.DecodeCrop(32, device="cuda")
    torch.manual_seed(0)
    jpeg, png = crop(photos[0]), crop(_png(photos[1]))
    assert isinstance(jpeg, Encoded) and jpeg.data == photos[0] and jpeg.pixels is None
    assert png.pixels is not None and png.pixels.shape == (3, 32, 32) and png.data == b""
    batch, labels = crop.collate([(jpeg, 1), (png, 2)])
    assert labels.tolist() == [1, 2]
    assert batch["offsets"].tolist() == [0, len(photos[0]), len(photos[0])]
    assert batch["ready"].tolist() == [1] and batch["boxes"].shape == (2, 4)


def test_device_stage_matches_the_cpu_decodecrop(photos: list[bytes], cpu_nvjpeg: list[int]) -> None:
    gpu, cpu = rt.data.DecodeCrop(48, device="cuda"), rt.data.DecodeCrop(48)
    files = [photos[0], _png(photos[1]), photos[2], photos[3]]
    torch.manual_seed(4)
    samples = [(gpu(f), i) for i, f in enumerate(files)]
    images, labels = gpu.collate.on_device(gpu.collate(samples), torch.device("cpu"))
    assert cpu_nvjpeg == [3]  # the JPEGs in one batched call; the PNG came as pixels
    assert images.shape == (4, 3, 48, 48) and images.dtype == torch.uint8
    assert labels.tolist() == [0, 1, 2, 3]
    for k, (enc, _) in enumerate(samples):
        ref = cpu.apply(files[k], enc.box, enc.flip)
        # float resize on the device vs the uint8 kernel on the CPU: rounding only
        assert np.abs(images[k].numpy().astype(int) - ref).mean() <= 1.0


def test_collate_refuses_samples_that_are_not_decodecrops() -> None:
    with pytest.raises(DataError, match="needs samples that are DecodeCrop's output"):
        rt.data.DecodeCrop(8, device="cuda").collate([(np.zeros(3), 1)])


def _folder(tmp_path: Path, files: list[bytes]) -> Path:
    for i, data in enumerate(files):
        d = tmp_path / f"c{i % 2}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(data)
    return tmp_path


@pytest.mark.timeout(60)
def test_loader_decodes_batches_on_the_device_stage(tmp_path: Path, photos: list[bytes],
                                                    cpu_nvjpeg: list[int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    backend = RunBackend()
    monkeypatch.setattr(loader_mod, "_make_backend", lambda device: backend)
    gpu = rt.data.DecodeCrop(40, device="cuda")
    ds = rt.data.ImageFolder(_folder(tmp_path, photos), decode=False, transform=gpu)
    cpu_ds = rt.data.ImageFolder(tmp_path, decode=False, transform=rt.data.DecodeCrop(40))
    with rt.data.Loader(ds, batch_size=4, num_workers=2, device="cuda", seed=3,
                        collate_fn=gpu.collate) as loader:
        got = [(x.clone(), y.clone()) for x, y in loader]
        assert loader.stats()["slots"] >= 1
    # the same crops as the CPU path draws (same seeds: one per batch, drawn in the workers)
    with rt.data.Loader(cpu_ds, batch_size=4, num_workers=2, device="cpu", seed=3,
                        collate_fn=lambda s: (torch.from_numpy(np.stack([a for a, _ in s])),
                                              torch.tensor([b for _, b in s]))) as ref_loader:
        want = [(x.clone(), y.clone()) for x, y in ref_loader]
    assert len(backend.events) == len(got) == 3 and sum(cpu_nvjpeg) == 10
    assert backend.copies == 0  # the device stage replaced the copy
    assert all(ev.complete for ev in backend.events)  # each batch waited for its stage
    for (x, y), (rx, ry) in zip(got, want, strict=True):
        assert x.shape[1:] == (3, 40, 40) and torch.equal(y, ry)
        # the same boxes; float resize on the device vs uint8 on the CPU: rounding only
        assert (x.int() - rx.int()).abs().float().mean() <= 1.0


@pytest.mark.timeout(60)
def test_cpu_loader_runs_the_device_stage_in_the_training_process(
        tmp_path: Path, photos: list[bytes], cpu_nvjpeg: list[int]) -> None:
    gpu = rt.data.DecodeCrop(24, device="cuda")
    ds = rt.data.ImageFolder(_folder(tmp_path, photos[:6]), decode=False, transform=gpu)
    with rt.data.Loader(ds, batch_size=3, num_workers=1, device="cpu", collate_fn=gpu.collate) as ld:
        shapes = [tuple(x.shape) for x, _ in ld]
    assert shapes == [(3, 3, 24, 24), (3, 3, 24, 24)] and cpu_nvjpeg == [3, 3]


def test_without_torchvision_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    with pytest.raises(DataError, match="needs torchvision with nvJPEG"):
        gpudecode.decode_jpegs([torch.zeros(4, dtype=torch.uint8)], torch.device("cpu"))
