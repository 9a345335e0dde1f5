"""backend='nccl' asked for with fewer GPUs than processes on the host is a ConfigError
at init, on every local rank: pin_device() left the ranks without a GPU on the CPU, and
their first collective failed inside NCCL (it moves only CUDA tensors)."""

from __future__ import annotations

import pytest
import torch

from ringtrain.errors import ConfigError
from ringtrain.runtime import backend


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_nccl_with_a_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 4)
    assert backend.choose_backend("nccl", 4) == "nccl"
    assert backend.choose_backend("auto", 4) == "nccl"


def test_nccl_with_fewer_gpus_than_processes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(ConfigError, match=r"one GPU per process on this host \(4 processes\).*sees 1"):
        backend.choose_backend("nccl", 4)
    assert backend.choose_backend("auto", 4) == "gloo"  # auto still falls back
    assert backend.choose_backend("gloo", 4) == "gloo"


def test_nccl_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="none is available"):
        backend.choose_backend("nccl", 1)
