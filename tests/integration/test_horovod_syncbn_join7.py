"""ringtrain.horovod: SyncBatchNorm against torch's BatchNorm on the concatenated batch
(half inputs, a batch of one value per channel, an empty batch, a gradient of its
gradient), the min/max/product of allreduce while a rank has ``join()``-ed, and
``broadcast_parameters`` given a value that is not a tensor. One 2-rank world runs
every scenario; the tests read it. Each test failed before its fix (the comment says
how)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import error_of, hvd_scenarios, run_world, scenario_results

#: A scenario that leaves the ranks out of step fails the world quickly.
STALL_S = "8"


def _in_step(hvd: Any) -> float:
    """An unnamed allreduce: 2.0 while the ranks are still in step (unnamed operations
    numbered alike included)."""
    return float(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())


def _rows(counts: list[int], rank: int) -> slice:
    return slice(sum(counts[:rank]), sum(counts[:rank + 1]))


def _against_batch_norm(hvd: Any, dtype: torch.dtype, counts: list[int], tail: tuple[int, ...],
                        momentum: float | None = 0.1, channels_last: bool = False) -> dict[str, float]:
    """Largest differences from torch's BatchNorm (in float64) on the whole batch, over
    two training steps: output, input gradient, summed weight/bias gradients, running
    statistics."""
    r, c = hvd.rank(), 3
    torch.manual_seed(0)
    sbn = hvd.SyncBatchNorm(c, momentum=momentum)
    bn = {0: torch.nn.BatchNorm1d, 1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d}[len(tail)](
        c, momentum=momentum).double()
    for m in (sbn, bn):
        with torch.no_grad():
            m.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    errs: dict[str, float] = {}
    for _ in range(2):  # the second step starts from the first's running statistics
        full = torch.randn(sum(counts), c, *tail, dtype=torch.float64) * 2 + 5
        # mostly positive: the sums of the gradient grow with the batch
        scale = 1 + 0.1 * torch.randn(full.shape, dtype=torch.float64)
        mine = full[_rows(counts, r)].to(dtype)
        if channels_last:
            mine = mine.contiguous(memory_format=torch.channels_last)
        mine.requires_grad_()
        whole = full.clone().requires_grad_()
        for m in (sbn, bn):
            m.zero_grad()
        out = sbn(mine)
        ref = bn(whole)
        (out.double() * scale[_rows(counts, r)]).sum().backward()
        (ref * scale).sum().backward()
        for key, got, want in [
            ("out", out.double(), ref[_rows(counts, r)]),
            ("dx", mine.grad.double(), whole.grad[_rows(counts, r)]),
            ("dw", hvd.allreduce(sbn.weight.grad.double(), op=hvd.Sum), bn.weight.grad),
            ("db", hvd.allreduce(sbn.bias.grad.double(), op=hvd.Sum), bn.bias.grad),
            ("running_mean", sbn.running_mean.double(), bn.running_mean),
            ("running_var", sbn.running_var.double(), bn.running_var),
        ]:
            scale_of = max(float(want.abs().max()), 1.0)
            err = float((got - want).abs().max()) / scale_of if got.numel() else 0.0
            errs[key] = max(errs.get(key, 0.0), err if err == err else float("inf"))  # NaN: inf
        errs["dtype"] = float(out.dtype != dtype)
    return errs


def _sbn_one_value(hvd: Any) -> dict[str, Any]:
    sbn = hvd.SyncBatchNorm(3)
    x = torch.randn(1 if hvd.rank() == 0 else 0, 3)
    return {"error": error_of(lambda: sbn(x)), "running_var": sbn.running_var.tolist(), "after": _in_step(hvd)}


def _sbn_empty(hvd: Any) -> dict[str, Any]:
    sbn = hvd.SyncBatchNorm(3, momentum=None)
    with torch.no_grad():
        sbn.running_mean.fill_(5.0)
        sbn.running_var.fill_(4.0)
    out = sbn(torch.randn(0, 3, 2))
    return {"shape": list(out.shape), "running_mean": sbn.running_mean.tolist(),
            "running_var": sbn.running_var.tolist(), "tracked": int(sbn.num_batches_tracked), "after": _in_step(hvd)}


def _sbn_double_backward(hvd: Any) -> dict[str, Any]:
    """A gradient penalty through SyncBatchNorm."""
    torch.manual_seed(1)
    sbn = hvd.SyncBatchNorm(3)
    x = torch.randn(4, 3, requires_grad=True)

    def penalty() -> None:
        (g,) = torch.autograd.grad((sbn(x) ** 3).sum(), x, create_graph=True)
        (g ** 2).sum().backward()

    return {"error": error_of(penalty), "after": _in_step(hvd)}


def _join_reductions(hvd: Any) -> dict[str, Any]:
    """Rank 0 joins; rank 1 reduces alone (the others' view: the values it got)."""
    got: dict[str, Any] = {}
    if hvd.rank() == 0:
        got["last"] = hvd.join()
        return got
    for label, t in [("pos", torch.tensor([3.0, 5.0])), ("neg", torch.tensor([-3.0, -5.0])),
                     ("int", torch.tensor([3, -5], dtype=torch.int32)), ("bool", torch.tensor([True, False]))]:
        for op in ("Min", "Max", "Product"):
            # named: the joined rank numbers no unnamed operation meanwhile
            got[f"{label}.{op}"] = hvd.allreduce(t, op=getattr(hvd, op), name=f"{label}.{op}").tolist()
    got["average"] = hvd.allreduce(torch.tensor([3.0]), op=hvd.Average, name="average").tolist()
    got["last"] = hvd.join()
    return got


def _broadcast_non_tensor(hvd: Any) -> dict[str, Any]:
    r = hvd.rank()
    same = {"w": torch.full((2,), float(r)), "epoch": r}
    one = {"a": torch.full((2,), float(r)), "b": None if r == 1 else torch.ones(1)}
    return {"same": error_of(lambda: hvd.broadcast_parameters(same, 0)), "same_w": same["w"].tolist(),
            "one": error_of(lambda: hvd.broadcast_parameters(one, 0)), "one_a": one["a"].tolist(),
            "after": _in_step(hvd)}


#: SyncBatchNorm comparisons: label -> (dtype, per-rank batch sizes, trailing dims, kw)
_SBN: dict[str, tuple[torch.dtype, list[int], tuple[int, ...], dict[str, Any]]] = {
    # before: the backward sums ran in fp16 and overflowed past 65504: dx all NaN
    "fp16_large": (torch.float16, [70_000, 70_000], (), {}),
    "bf16": (torch.bfloat16, [6, 9], (4,), {}),
    "uneven_cumulative": (torch.float32, [1, 6], (4,), {"momentum": None}),
    "channels_last": (torch.float32, [2, 3], (3, 4), {"channels_last": True}),
}
_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-5}


def _scenarios(hvd: Any) -> list[tuple[str, Any]]:
    return ([(label, lambda spec=spec: _against_batch_norm(hvd, spec[0], spec[1], spec[2], **spec[3]))
             for label, spec in _SBN.items()]
            + [("sbn_one_value", lambda: _sbn_one_value(hvd)), ("sbn_empty", lambda: _sbn_empty(hvd)),
               ("sbn_double_backward", lambda: _sbn_double_backward(hvd)),
               ("join_reductions", lambda: _join_reductions(hvd)),
               ("broadcast_non_tensor", lambda: _broadcast_non_tensor(hvd))])


def _world() -> dict[str, Any]:
    return hvd_scenarios(_scenarios)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, init=False, env={"RINGTRAIN_STALL_TIMEOUT": STALL_S}, timeout=100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label", list(_SBN))
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(world: list[dict[str, Any]], label: str) -> None:
    tolerance = _TOLERANCE[_SBN[label][0]]
    for rank, errs in enumerate(scenario_results(world, label)):
        bad = {k: v for k, v in errs.items() if not v <= tolerance}
        assert not bad, (rank, bad)


@pytest.mark.timeout(120)
def test_sync_batch_norm_of_one_value_per_channel_is_an_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    # Before: no error; the output was 0 and the running variance shrank to 0.9.
    for out in scenario_results(world, "sbn_one_value", after=2.0):
        assert out["error"] is not None and out["error"][0] == "ValueError", out
        assert "more than 1 value per channel" in out["error"][1], out
        assert out["running_var"] == [1.0, 1.0, 1.0], out


@pytest.mark.timeout(120)
def test_sync_batch_norm_of_an_empty_batch_keeps_the_running_statistics(world: list[dict[str, Any]]) -> None:
    # Before: the mean of no values (NaN) replaced them, as torch's BatchNorm does not.
    for out in scenario_results(world, "sbn_empty", after=2.0):
        assert out["shape"] == [0, 3, 2]
        assert out["running_mean"] == [5.0] * 3 and out["running_var"] == [4.0] * 3, out
        assert out["tracked"] == 1


@pytest.mark.timeout(120)
def test_a_gradient_of_the_sync_batch_norm_gradient_is_an_error(world: list[dict[str, Any]]) -> None:
    # Before: the job-wide sums and the statistics were constants to it: a gradient
    # penalty's weight gradient was off (5e-6 relative in float64), silently.
    for out in scenario_results(world, "sbn_double_backward", after=2.0):
        assert out["error"] is not None and "once_differentiable" in out["error"][1], out


@pytest.mark.timeout(120)
def test_a_joined_rank_leaves_min_max_and_product_to_the_ranks_with_data(world: list[dict[str, Any]]) -> None:
    # Before: the joined rank's zeros took part, so min and product of positive values,
    # and max of negative ones, came back 0.
    r0, r1 = scenario_results(world, "join_reductions")
    assert r0["last"] == r1["last"] == 1
    for label, values in [("pos", [3.0, 5.0]), ("neg", [-3.0, -5.0]), ("int", [3, -5]), ("bool", [True, False])]:
        for op in ("Min", "Max", "Product"):
            assert r1[f"{label}.{op}"] == values, (label, op, r1[f"{label}.{op}"])
    assert r1["average"] == [1.5]  # Horovod's: zeros, divided by the whole size


@pytest.mark.timeout(120)
def test_broadcast_parameters_of_a_non_tensor_is_an_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    # Before: non-tensors were skipped, so each rank kept its own value, silently.
    r0, r1 = scenario_results(world, "broadcast_non_tensor", after=2.0)
    for out, rank in ((r0, 0), (r1, 1)):
        assert out["same"] is not None and out["same"][0] == "ValueError" and "'epoch'" in out["same"][1], out
        assert out["same_w"] == [float(rank)] * 2  # nothing overwritten
        assert out["one_a"] == [float(rank)] * 2
    assert r1["one"] is not None and r1["one"][0] == "ValueError" and "'b'" in r1["one"][1], r1
    assert r0["one"] is not None and r0["one"][0] == "NegotiationError" and "rank 1" in r0["one"][1], r0
