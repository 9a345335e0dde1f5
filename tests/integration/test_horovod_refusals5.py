"""ringtrain.horovod against Horovod's semantics, fifth audit: a call that fails one of
its own checks on one rank only (a bool tensor averaged, alltoall splits, a root_rank,
a scale factor, a grouped list, a reducescatter op, broadcast_parameters) is one error
on every rank, and a stale handle given to ``poll``. One 2-rank world runs every
scenario (each records what it saw, and whether the ranks were still in step after
it); the tests read it. Each test failed before its fix (the comment says how)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import error_of, hvd_scenarios, run_world, scenario_results

#: Short enough that a scenario which stalls (as they did before their fixes) fails the
#: world quickly, long enough for a loaded 2-core machine.
STALL_S = "6"


def _in_step(hvd: Any) -> list[float]:
    """A named and an unnamed allreduce after the scenario: [1.0, 2.0] when every rank
    is still in step, unnamed operations numbered alike included."""
    named = hvd.allreduce(torch.full((1,), float(hvd.rank())), op=hvd.Sum, name=f"step.{_in_step.n}")
    _in_step.n += 1
    unnamed = hvd.allreduce(torch.ones(1), op=hvd.Sum)
    return [float(named.item()), float(unnamed.item())]


_in_step.n = 0  # type: ignore[attr-defined]

#: scenario -> (the rank whose own check fails, the call as that rank and the others make it)
_CALLS: dict[str, tuple[int, Any]] = {
    "bool_average": (1, lambda hvd, bad: hvd.allreduce(
        torch.tensor([True, False]) if bad else torch.ones(2), op=hvd.Average)),
    "alltoall_splits": (0, lambda hvd, bad: hvd.alltoall(torch.arange(4.0), splits=[3, 3] if bad else [2, 2])),
    "root_rank": (1, lambda hvd, bad: hvd.broadcast(torch.ones(2), "0" if bad else 0)),
    "prescale": (0, lambda hvd, bad: hvd.allreduce(torch.ones(2), op=hvd.Sum,
                                                   prescale_factor="half" if bad else 1.0)),
    "grouped": (1, lambda hvd, bad: hvd.synchronize(hvd.grouped_allreduce_async([torch.ones(2), [1.0, 2.0] if bad else torch.ones(2)]))),
    "reducescatter_op": (0, lambda hvd, bad: hvd.reducescatter(torch.ones(4), op=hvd.Max if bad else hvd.Sum)),
    "broadcast_parameters": (1, lambda hvd, bad: hvd.broadcast_parameters(
        [torch.ones(2), torch.ones(3)], root_rank=0.5 if bad else 0)),
}


def _refusal(hvd: Any, label: str) -> dict[str, Any]:
    bad_rank, call = _CALLS[label]
    return {"error": error_of(lambda: call(hvd, hvd.rank() == bad_rank)), "after": _in_step(hvd)}


def _poll(hvd: Any) -> dict[str, Any]:
    h = hvd.allreduce_async(torch.ones(1), op=hvd.Sum, name="poll")
    value = hvd.synchronize(h).tolist()
    return {"value": value, "cleared": error_of(lambda: hvd.poll(h)), "never": error_of(lambda: hvd.poll(10 ** 6)),
            "again": hvd.synchronize(h), "after": _in_step(hvd)}


def _scenarios(hvd: Any) -> list[tuple[str, Any]]:
    return ([("poll", lambda: _poll(hvd))]
            + [(label, lambda label=label: _refusal(hvd, label)) for label in _CALLS])


def _world() -> dict[str, Any]:
    return hvd_scenarios(_scenarios)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, init=False, env={"RINGTRAIN_STALL_TIMEOUT": STALL_S}, timeout=100)


def _scenario(world: list[dict[str, Any]], label: str) -> list[Any]:
    return scenario_results(world, label, after=[1.0, 2.0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("label", "kind", "words"), [
    ("bool_average", "ValueError", "bool"),
    ("alltoall_splits", "ValueError", "splits"),
    ("root_rank", "ValueError", "root_rank"),
    ("prescale", "ValueError", "half"),
    ("grouped", "ValueError", "torch.Tensor"),
    ("reducescatter_op", "HorovodUsageError", "hvd.Max"),
    ("broadcast_parameters", "ValueError", "root_rank"),
])
def test_a_check_failing_on_one_rank_is_an_error_on_every_rank(world: list[dict[str, Any]], label: str,
                                                               kind: str, words: str) -> None:
    # Before: the rank whose check failed raised before submitting anything; the other
    # waited for the operation for ever (Horovod's default) or, here, until the stall
    # limit, and that rank's unnamed operations were numbered one short from then on.
    bad = _CALLS[label][0]
    outs = _scenario(world, label)
    mine, other = outs[bad]["error"], outs[1 - bad]["error"]
    assert mine is not None and mine[0] == kind and words in mine[1], mine
    assert other is not None and other[0] == "NegotiationError", other
    assert f"rank {bad}" in other[1] and words in other[1], other


@pytest.mark.timeout(120)
def test_poll_of_a_cleared_or_unknown_handle_is_a_value_error(world: list[dict[str, Any]]) -> None:
    # Before: hvd.poll said True for both; Horovod's handle manager raises ValueError.
    for o in _scenario(world, "poll"):
        assert o["value"] == [2.0]
        for key in ("cleared", "never"):
            assert o[key] is not None and o[key][0] == "ValueError", o[key]
            assert "was not created or has been cleared" in o[key][1], o[key]
        assert o["again"] is None  # Horovod's synchronize of a cleared handle returns None
