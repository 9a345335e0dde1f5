"""Host and device paths share everything but where the buffers live.

No GPU here: the device path is exercised with ``meta`` tensors (same code, no data)
and with the lockstep fake transport, which runs NCCL's rules on CPU. Whether a CPU
exchange stages its tensor is checked on the real code path of ``P2PStrategy``.
"""

from __future__ import annotations

import types

import pytest
import sync_fakes
import torch
from sync_fakes import run_ranks

from ringtrain.collectives import ReduceOp
from ringtrain.sync import ParameterServer, Ring
from ringtrain.sync._tensors import ScratchPool, flat_work
from ringtrain.sync.channel import channel

STRATEGIES = [Ring(chunks_per_rank=2), ParameterServer(servers=1), ParameterServer(servers=3)]


def test_a_contiguous_tensor_on_the_channels_device_is_used_in_place() -> None:
    x = torch.arange(12.0).view(3, 4)
    flat, back = flat_work(x, "cpu")
    assert back is None  # no staging copy, nothing to write back
    assert flat.data_ptr() == x.data_ptr() and flat.shape == (12,)
    dev = torch.empty(5, device="meta")  # stands in for a GPU tensor on an NCCL channel
    flat, back = flat_work(dev, "meta")
    assert back is None and flat.device.type == "meta"


def test_a_non_contiguous_tensor_is_staged_and_written_back() -> None:
    x = torch.arange(12.0).view(3, 4).t()
    flat, back = flat_work(x, "cpu")
    assert back is not None and flat.data_ptr() != x.data_ptr()
    flat.mul_(2)
    back()
    torch.testing.assert_close(x, (torch.arange(12.0).view(3, 4) * 2).t())


def test_scratch_lives_on_the_channels_device() -> None:
    assert ScratchPool("meta").get(torch.float32, 10).device.type == "meta"
    assert ScratchPool().get(torch.float16, 3).device.type == "cpu"


@pytest.mark.parametrize("lockstep", [False, True], ids=["gloo", "nccl-lockstep"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_device_buffers_never_leave_the_device(strategy: Ring | ParameterServer, lockstep: bool) -> None:
    # The fake channel refuses any message whose buffer is not on its device, so an
    # algorithm that staged through the host would fail here.
    n = 4

    def rank(ch: sync_fakes.FakeChannel) -> torch.device:
        flat = torch.empty(1000, device="meta")
        strategy.exchange(flat, ReduceOp.AVERAGE, ch)
        return flat.device

    devices, hub = run_ranks(n, rank, lockstep=lockstep, device="meta")
    assert all(d.type == "meta" for d in devices)
    assert sum(hub.bytes_sent.values()) > 0


def test_receives_posted_ahead_deadlock_under_lockstep_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    # The control: Gloo's early receives, run on NCCL's rules, never finish. This is why
    # the algorithms read ch.lockstep.
    monkeypatch.setattr(sync_fakes, "_WAIT_S", 1.0)

    def rank(ch: sync_fakes.FakeChannel) -> None:
        ch.lockstep = False  # lie: post receives two rounds ahead on a lockstep hub
        Ring(chunks_per_rank=1).exchange(torch.ones(64), ReduceOp.SUM, ch)

    with pytest.raises(TimeoutError, match="deadlock"):
        run_ranks(2, rank, lockstep=True)


def test_lockstep_batches_hold_one_round_each() -> None:
    # N = 3, one piece: 2(N-1) = 4 rounds, each one batch (send + receive) per rank.
    _, hub = run_ranks(3, lambda ch: Ring(chunks_per_rank=1).exchange(torch.ones(30), ReduceOp.SUM, ch),
                       lockstep=True)
    assert hub.batches == 3 * 4


def test_cpu_exchange_runs_on_the_host_transport_without_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    import ringtrain as rt
    from ringtrain.sync import base

    seen: list[tuple[bool, bool]] = []
    real = base.flat_work

    def spy(tensor: torch.Tensor, device: torch.device | str = "cpu"):  # type: ignore[no-untyped-def]
        flat, back = real(tensor, device)
        seen.append((back is None, flat.data_ptr() == tensor.data_ptr()))
        return flat, back

    monkeypatch.setattr(base, "flat_work", spy)
    monkeypatch.setattr(base.runtime, "size", lambda: 2)  # reach the exchange path
    monkeypatch.setattr(Ring, "exchange", lambda self, flat, op, ch: flat.mul_(2))
    rt.init()
    try:
        x = torch.ones(8)
        Ring()(x, ReduceOp.SUM, "x").wait()
        assert seen == [(True, True)]  # in place: no copy, no write-back
        torch.testing.assert_close(x, torch.full((8,), 2.0))
        ch = channel("cpu")
        assert ch.device.type == "cpu" and not ch.lockstep
        assert type(ch.transport).__name__ == "GlooTransport"
    finally:
        rt.shutdown()


def test_cuda_tensors_go_to_the_device_channel_only_under_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringtrain.sync import channel as channel_mod

    gpu = types.SimpleNamespace(device=torch.device("cuda", 1))
    monkeypatch.setattr(channel_mod.runtime, "world", lambda: types.SimpleNamespace(backend="nccl"))
    assert channel_mod.channel_device(gpu) == torch.device("cuda", 1)  # type: ignore[arg-type]
    assert channel_mod.channel_device(torch.ones(1)) == torch.device("cpu")
    monkeypatch.setattr(channel_mod.runtime, "world", lambda: types.SimpleNamespace(backend="gloo"))
    assert channel_mod.channel_device(gpu) == torch.device("cpu")  # type: ignore[arg-type]
