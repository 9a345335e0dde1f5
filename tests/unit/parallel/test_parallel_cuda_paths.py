"""The CUDA paths of ringtrain.parallel, checked on CPU with recorders in place of torch.cuda:
which device parallelize() makes current (FSDP2 shards onto the current device), where its
first-step gather runs under NCCL, whose memory counter state_memory reads, and that
clipping copies no gradient's share to the host one by one (a device sync each)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ringtrain import runtime
from ringtrain.errors import ConfigError
from ringtrain.parallel import clip, engine, memory


class _FakeCuda:
    """torch.cuda as parallelize() sees it on a host with ``count`` GPUs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int = 4, current: int = 0,
                 initialized: bool = True) -> None:
        self.current = current
        self.initialized = initialized
        self.set_calls: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "current_device", self._current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set)
        monkeypatch.setattr(runtime, "is_initialized", lambda: False)

    def _current(self) -> int:
        self.initialized = True
        return self.current

    def _set(self, device: Any) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        assert index is not None
        self.set_calls.append(index)
        self.current = index
        self.initialized = True


def test_an_explicit_cuda_device_becomes_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda(monkeypatch, current=0)
    assert engine._resolve_device("cuda:1") == torch.device("cuda", 1)
    assert cuda.set_calls == [1] and cuda.current == 1


def test_cuda_without_an_index_is_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda(monkeypatch, current=2)
    assert engine._resolve_device("cuda") == torch.device("cuda", 2)
    assert cuda.set_calls == []


def test_before_init_and_before_cuda_the_default_is_the_local_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # What DeviceMesh would pick, had nothing initialised CUDA on device 0 first.
    cuda = _FakeCuda(monkeypatch, current=0, initialized=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert engine._resolve_device(None) == torch.device("cuda", 3)
    assert cuda.set_calls == [3]


def test_a_device_the_script_already_chose_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda(monkeypatch, current=1, initialized=True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert engine._resolve_device(None) == torch.device("cuda", 1)
    assert cuda.set_calls == [1]  # made current again: a no-op


def test_a_missing_device_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda(monkeypatch, count=2)
    with pytest.raises(ConfigError, match="does not exist"):
        engine._resolve_device("cuda:5")
    with pytest.raises(ConfigError, match="parallelize"):
        engine._resolve_device("gpu:0")


def test_the_checks_gather_on_this_ranks_device_under_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def gather(obj: Any, group: Any = None, device: torch.device | None = None) -> list[Any]:
        seen.append(device)
        return [obj, obj]

    def no_current() -> int:
        raise AssertionError("the gather must not fall back to the current device")

    monkeypatch.setattr(engine.dist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(engine.inflight, "gather_objects", gather)
    monkeypatch.setattr(torch.cuda, "current_device", no_current)
    engine._agree(None, 1, 2, [1.0], torch.device("cuda", 1))
    assert seen == [torch.device("cuda", 1)]


def test_state_memory_reads_the_parameters_device_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []

    def allocated(device: Any = None) -> int:
        asked.append(device)
        return 123

    class Storage:
        def nbytes(self) -> int:
            return 16

        def data_ptr(self) -> int:
            return 1000

    class OnCuda1:
        is_cuda = True
        device = torch.device("cuda", 1)
        grad = None

        def untyped_storage(self) -> Storage:
            return Storage()

    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    got = memory.state_memory([OnCuda1()])  # type: ignore[list-item]
    assert got.cuda_allocated == 123 and got.parameters == 16
    assert asked == [torch.device("cuda", 1)]


def _grads() -> list[nn.Parameter]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(2, 2))]
    for q in params:
        q.grad = torch.randn_like(q) * 3
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clipping_equals_torchs_in_one_process(norm_type: float) -> None:
    ours, theirs = _grads(), _grads()
    got = clip.clip_grad_norm(ours, 0.5, norm_type)
    want = float(torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type))
    assert got == pytest.approx(want, rel=1e-6)
    for a, b in zip(ours, theirs, strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad)


def test_clipping_copies_no_share_to_the_host_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA each .cpu() of a per-gradient share waited for the device: a sync per
    # parameter, every step. The shares stay on the gradient's device.
    share = clip._local_share(torch.empty(4, 4, device="meta"), 1, 2.0)
    assert share.device.type == "meta"
    calls = 0
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    clip.clip_grad_norm(_grads(), 0.5)
    assert calls == 0
