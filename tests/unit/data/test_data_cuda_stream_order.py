"""The CUDA calls of the loader's device path, in order, on the CPU: torch.cuda's stream,
event, device and runtime entry points are replaced by recorders, so each test checks
which call comes before which (what a real GPU needs, and a CPU run cannot show)."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ringtrain.data import gpudecode
from ringtrain.data.prefetch import CudaBackend


class _Stream:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(f"synchronize {self.name}")


class _Event:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self, stream: Any = None) -> None:
        self.log.append("record")


@pytest.fixture()
def cuda_log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """torch.cuda's entry points as recorders; the calls land in the returned list."""
    log: list[str] = []
    current = ["cuda:0"]  # the current device

    @contextlib.contextmanager
    def device(dev: Any) -> Iterator[None]:
        old, current[0] = current[0], str(torch.device(dev))
        try:
            yield
        finally:
            current[0] = old

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[None]:
        log.append(f"on {s.name}")
        yield

    class _Runtime:
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            log.append(f"register on {current[0]}")
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            log.append(f"unregister on {current[0]}")
            return 0

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream(log, "side"))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _Event(log))
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Runtime())
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: _Stream(log, f"current of {torch.device(device)}"))
    return log


def test_nvjpeg_decode_waits_for_the_stream_it_allocates_on(
        cuda_log: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # torchvision allocates the images on the current stream and nvJPEG writes them on
    # its own stream: blocks freed with kernels still queued (the previous batch's
    # images and resize buffers) must be idle before it is handed any.
    io = types.ModuleType("torchvision.io")
    io.ImageReadMode = types.SimpleNamespace(RGB="RGB")  # type: ignore[attr-defined]

    def decode_jpeg(files: list[torch.Tensor], mode: str, device: Any) -> list[torch.Tensor]:
        cuda_log.append(f"decode {len(files)} on {device}")
        return [torch.zeros(3, 2, 2, dtype=torch.uint8) for _ in files]

    io.decode_jpeg = decode_jpeg  # type: ignore[attr-defined]
    vision = types.ModuleType("torchvision")
    vision.io = io  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", vision)
    monkeypatch.setitem(sys.modules, "torchvision.io", io)
    files = [torch.zeros(8, dtype=torch.uint8)] * 2
    assert len(gpudecode.decode_jpegs(files, torch.device("cuda", 1))) == 2
    assert cuda_log == ["synchronize current of cuda:1", "decode 2 on cuda:1"]
    cuda_log.clear()
    gpudecode.decode_jpegs(files, torch.device("cpu"))  # no stream on the CPU
    assert cuda_log == ["decode 2 on cpu"]


def test_slots_are_page_locked_under_the_loaders_device(cuda_log: list[str]) -> None:
    # Not under whatever device is current (0 in a process that never set one): the
    # runtime call would make a context on that GPU.
    backend = CudaBackend(torch.device("cuda", 3))
    assert backend.register(4096, 4096)
    backend.unregister(4096)
    assert cuda_log == ["register on cuda:3", "unregister on cuda:3"]


def test_a_failed_stage_lets_its_queued_copies_finish_before_raising(cuda_log: list[str]) -> None:
    backend = CudaBackend(torch.device("cuda", 0))

    def stage(host: Any, device: Any) -> Any:
        cuda_log.append("copy queued")  # a non_blocking copy out of the host slot
        raise MemoryError("CUDA out of memory")  # e.g. the next field's allocation

    with pytest.raises(MemoryError):
        backend.run(stage, None)
    # The stager never tracks this batch (no end event), and the loader unregisters
    # and unmaps its slot next: the side stream must have drained first.
    assert cuda_log == ["on side", "record", "copy queued", "synchronize side"]
    cuda_log.clear()
    out, _, _ = backend.run(lambda host, device: host + 1, 1)
    assert out == 2 and cuda_log == ["on side", "record", "record"]  # no wait when it works
