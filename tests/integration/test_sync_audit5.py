"""Sync audit 5: a tensor that requires grad reduced in place by every strategy, on one
2-rank Gloo world shared by the module.

``rt.allreduce_(param)`` is what torch's ``dist.all_reduce(param)`` and Horovod's
``hvd.allreduce_(param)`` accept (they write outside autograd). Before the fix: native
left the parameter holding the *sum* (3.0, not the mean 1.5) and raised; ring and ps
raised on the exchange thread mid-round, and every later ring/ps exchange of the job
stalled.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_scenarios, run_world, scenario_results

N = 2
ALGOS = ("native", "ring", "ps")


def _in_place(algo: str, op_name: str, transposed: bool,
              dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    import ringtrain as rt

    r = rt.rank()
    base = (torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * r).to(dtype)
    param = torch.nn.Parameter(base.t().clone().t() if transposed else base.clone())
    out = rt.allreduce_(param, op=getattr(rt, op_name), algorithm=algo)
    after = rt.allreduce(torch.ones(1), op=rt.Sum, algorithm=algo).item()
    return {"value": param.detach().clone(), "same": out is param, "requires_grad": param.requires_grad,
            "after": after}


def _world() -> dict[str, Any]:
    scenarios = [(f"{algo}-{op}-{'t' if t else 'c'}",
                  lambda a=algo, o=op, tr=t: _in_place(a, o, tr))  # type: ignore[misc]
                 for algo in ALGOS for op in ("Average", "Sum") for t in (False, True)]
    # fp16 averages are summed in float32 and copied back: that copy is in place too
    scenarios += [(f"{algo}-fp16", lambda a=algo: _in_place(a, "Average", False, torch.float16))  # type: ignore[misc]
                  for algo in ALGOS]
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, N, timeout=40, env={"RINGTRAIN_STALL_TIMEOUT": "4"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("op", ["Average", "Sum"])
@pytest.mark.parametrize("algo", ALGOS)
def test_a_parameter_is_reduced_in_place(world: list[dict[str, Any]], algo: str, op: str,
                                         transposed: bool) -> None:
    label = f"{algo}-{op}-{'t' if transposed else 'c'}"
    total = sum(torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * k for k in range(N))
    expected = total / N if op == "Average" else total
    for got in scenario_results(world, label, after=float(N)):
        assert got["same"] and got["requires_grad"], got
        assert torch.equal(got["value"], expected), (label, got["value"], expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ALGOS)
def test_an_fp16_parameter_is_averaged_in_place(world: list[dict[str, Any]], algo: str) -> None:
    total = sum(torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * k for k in range(N))
    for got in scenario_results(world, f"{algo}-fp16", after=float(N)):
        assert got["same"] and got["requires_grad"], got
        assert torch.equal(got["value"], (total / N).half()), got["value"]


def _exchange_after_a_stall() -> dict[str, Any]:
    """Rank 1 comes to the first exchange after rank 0 gave up on it; rank 0 goes on to a
    second exchange just as rank 1's first rounds arrive, under the same tags."""
    import time

    import ringtrain as rt

    # the optimizer's path: the strategy itself, no agreement check before each bucket
    ring = rt.sync.make_strategy("ring", stall_timeout=1.0)
    out: dict[str, Any] = {}
    if rt.rank() == 1:
        time.sleep(2.5)
    try:
        ring(torch.ones(4) * (rt.rank() + 1), rt.Average, "bucket.0").wait()
        out["first"] = "done"
    except rt.errors.CollectiveError as exc:
        out["first"] = type(exc).__name__
    if rt.rank() == 0:
        time.sleep(1.3)  # its second exchange is receiving when rank 1's first one sends
    try:
        out["second"] = ring(torch.full((4,), 10.0 * (rt.rank() + 1)), rt.Average, "bucket.1").wait().tolist()
    except rt.errors.CollectiveError as exc:
        out["second"] = str(exc)
    return out


@pytest.mark.timeout(60)
def test_no_exchange_runs_on_a_channel_an_earlier_failure_ended() -> None:
    got = run_world(_exchange_after_a_stall, N, timeout=40, env={"RINGTRAIN_STALL_TIMEOUT": "1"})
    assert got[0]["first"] == "StallError", got
    # not rank 1's first exchange taken for rank 0's second (6.0 on rank 0, an error on 1)
    for out in got:
        assert isinstance(out["second"], str) and "an earlier ring/ps exchange failed" in out["second"], got
