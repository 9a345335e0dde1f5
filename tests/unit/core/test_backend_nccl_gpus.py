"""Which GPU a process uses and which backend the job takes, from what each process
sees (CUDA replaced by stand-ins: no GPU here).

- backend='nccl' asked for with fewer GPUs than processes on the host is a ConfigError
  at init, on every local rank: pin_device() left the ranks without a GPU on the CPU,
  and their first collective failed inside NCCL (it moves only CUDA tensors).
- A process given GPUs of its own (``srun --gpus-per-task=1``: each task sees one GPU,
  as ``cuda:0``, through its own CUDA_VISIBLE_DEVICES) uses ``cuda:0`` and the job NCCL;
  local rank r on ``cuda:r`` left every rank but the first on the CPU, with Gloo."""

from __future__ import annotations

import pytest
import torch

from ringtrain.env import LaunchEnv
from ringtrain.errors import ConfigError
from ringtrain.runtime import backend


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> list[int]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    pinned: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
    return pinned


def _env(launcher: str = "ringrun", local_rank: int = 2, local_size: int = 4) -> LaunchEnv:
    return LaunchEnv(launcher, local_rank, local_size, local_rank, local_size, 0, 1, "127.0.0.1", 29500)


def test_nccl_with_a_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = _gpus(monkeypatch, 4)
    assert backend.choose_backend("nccl", _env()) == "nccl"
    assert backend.choose_backend("auto", _env()) == "nccl"
    assert backend.pin_device(_env()) == torch.device("cuda", 2) and pinned == [2]


def test_nccl_with_fewer_gpus_than_processes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = _gpus(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(ConfigError, match=r"one GPU per process on this host \(4 processes\).*sees 1"):
        backend.choose_backend("nccl", _env())
    assert backend.choose_backend("auto", _env()) == "gloo"  # auto still falls back
    assert backend.choose_backend("gloo", _env()) == "gloo"
    assert backend.pin_device(_env()) == torch.device("cpu") and pinned == []  # ringrun: no binding


@pytest.mark.parametrize("launcher", ["slurm", "mpirun", "torchrun"])
def test_a_process_with_a_gpu_of_its_own_uses_it_with_nccl(monkeypatch: pytest.MonkeyPatch, launcher: str) -> None:
    pinned = _gpus(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    env = _env(launcher)
    assert backend.own_gpus(env)
    assert backend.choose_backend("auto", env) == "nccl"
    assert backend.choose_backend("nccl", env) == "nccl"
    assert backend.pin_device(env) == torch.device("cuda", 0) and pinned == [0]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # not bound: the old rule
    assert not backend.own_gpus(env) and backend.choose_backend("auto", env) == "gloo"


def test_nccl_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="none is available"):
        backend.choose_backend("nccl", _env(local_rank=0, local_size=1))
