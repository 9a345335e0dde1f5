"""ringtrain.horovod: a call that fails on one rank only where the refusal of its own
checks did not reach (the synchronous forms' checks before their ``*_async`` call, an
empty grouped list, a process set this rank cannot use) is one error on every rank, and
later calls, unnamed ones included, still match. One 2-rank world runs every scenario
(each records what it saw, and whether the ranks were still in step after it); the
tests read it. Each test failed before its fix: the rank that passed a good call waited
for the bad rank until the stall limit (Horovod's default: for ever)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import error_of, hvd_scenarios, run_world, scenario_results

#: Short enough that a scenario which stalls (as they did before the fix) fails the
#: world quickly, long enough for a loaded 2-core machine.
STALL_S = "4"


def _in_step(hvd: Any, ps: Any = None) -> list[float]:
    """A named and an unnamed allreduce (in ``ps`` too): [1.0, 2.0] when the ranks are
    still in step, unnamed operations numbered alike included."""
    _in_step.n += 1  # type: ignore[attr-defined]
    sets = [None] if ps is None else [None, ps]
    out = [float(hvd.allreduce(torch.full((1,), float(hvd.rank())), op=hvd.Sum,
                               name=f"step.{_in_step.n}").item())]  # type: ignore[attr-defined]
    out += [float(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=s).item()) for s in sets]
    return out


_in_step.n = 0  # type: ignore[attr-defined]


class _Broken:
    """A compressor that fails (on the one rank that uses it)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Any:
        raise TypeError("broken compressor")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


_T = torch.ones(4)
#: scenario -> (the bad rank, the call as the bad rank and the other make it)
_CALLS: dict[str, tuple[int, Any]] = {
    "allreduce_average": (1, lambda hvd, bad: hvd.allreduce(_T, op=hvd.Sum, average=True if bad else None)),
    "allreduce_list": (0, lambda hvd, bad: hvd.allreduce([1.0] * 4 if bad else _T)),
    "allreduce_compressor": (1, lambda hvd, bad: hvd.allreduce(_T, compression=_Broken if bad else hvd.Compression.none)),
    "grouped_allreduce_average": (0, lambda hvd, bad: hvd.grouped_allreduce([_T, _T], op=hvd.Sum,
                                                                            average=False if bad else None)),
    "grouped_allreduce_list": (1, lambda hvd, bad: hvd.grouped_allreduce([_T, [1.0] if bad else _T, _T])),
    "allgather_list": (0, lambda hvd, bad: hvd.allgather([1.0] if bad else _T)),
    "grouped_allgather_list": (1, lambda hvd, bad: hvd.grouped_allgather([[1.0] if bad else _T, _T])),
    "grouped_allgather_scalar": (0, lambda hvd, bad: hvd.grouped_allgather([torch.tensor(1.0) if bad else _T])),
    "reducescatter_list": (1, lambda hvd, bad: hvd.reducescatter([1.0] * 4 if bad else _T)),
    "grouped_reducescatter_list": (0, lambda hvd, bad: hvd.grouped_reducescatter([_T, [1.0] if bad else _T])),
    # an empty group: the others' whole group is refused, whatever its length
    "empty_grouped_allreduce": (1, lambda hvd, bad: hvd.grouped_allreduce([] if bad else [_T, _T, _T])),
    "empty_grouped_allreduce_": (0, lambda hvd, bad: hvd.grouped_allreduce_([] if bad else [_T.clone(), _T.clone()])),
    "empty_grouped_allgather": (1, lambda hvd, bad: hvd.grouped_allgather([] if bad else [_T, _T])),
    "empty_grouped_reducescatter": (0, lambda hvd, bad: hvd.grouped_reducescatter([] if bad else [_T, _T])),
}

#: what the bad rank raises (Horovod's type) and a word of it
_EXPECTED = {
    "allreduce_average": ("ValueError", "supersedes average"),
    "allreduce_list": ("ValueError", "torch.Tensor"),
    "allreduce_compressor": ("TypeError", "broken compressor"),
    "grouped_allreduce_average": ("ValueError", "supersedes average"),
    "grouped_allreduce_list": ("ValueError", "torch.Tensor"),
    "allgather_list": ("ValueError", "torch.Tensor"),
    "grouped_allgather_list": ("ValueError", "torch.Tensor"),
    "reducescatter_list": ("ValueError", "torch.Tensor"),
    "grouped_reducescatter_list": ("ValueError", "torch.Tensor"),
    "empty_grouped_allreduce": ("ValueError", "empty list"),
    "empty_grouped_allreduce_": ("ValueError", "empty list"),
    "empty_grouped_allgather": ("ValueError", "empty list"),
    "empty_grouped_reducescatter": ("ValueError", "empty list"),
}


def _refusal(hvd: Any, label: str) -> dict[str, Any]:
    bad_rank, call = _CALLS[label]
    return {"error": error_of(lambda: call(hvd, hvd.rank() == bad_rank)), "after": _in_step(hvd)}


def _named_group_again(hvd: Any) -> dict[str, Any]:
    """An empty named group on rank 1, then the same name on both: the other rank's
    members the bad rank never named are not left pending under that name."""
    first = error_of(lambda: hvd.grouped_allreduce([] if hvd.rank() == 1 else [_T, _T], name="again"))
    between = _in_step(hvd)  # (the bad rank's own refusal is decided by then)
    again = [t.tolist() for t in hvd.grouped_allreduce([_T, _T], op=hvd.Sum, name="again")]
    return {"first": first, "between": between, "again": again, "after": _in_step(hvd)}


def _process_sets(hvd: Any) -> dict[str, Any]:
    """Rank 1 passes a set it cannot use: an unregistered copy of a registered one, then
    the registered one after removing it on rank 1 only; then a list of ranks."""
    bad = hvd.rank() == 1
    ps = hvd.add_process_set([0, 1])
    out: dict[str, Any] = {
        "copy": error_of(lambda: hvd.allreduce(_T, process_set=hvd.ProcessSet([0, 1]) if bad else ps)),
        "copy_after": _in_step(hvd, ps),
    }
    if bad:
        hvd.remove_process_set(ps)
    out["removed"] = error_of(lambda: hvd.allgather(_T, process_set=ps))
    out["removed_after"] = _in_step(hvd)
    if not bad:
        hvd.remove_process_set(ps)
    out["list"] = error_of(lambda: hvd.broadcast(_T, 0, process_set=[0, 1] if bad else hvd.global_process_set))
    out["after"] = _in_step(hvd)
    return out


def _scenarios(hvd: Any) -> list[tuple[str, Any]]:
    return ([(label, lambda label=label: _refusal(hvd, label)) for label in _CALLS]
            + [("named_group_again", lambda: _named_group_again(hvd)), ("process_sets", lambda: _process_sets(hvd))])


def _world() -> dict[str, Any]:
    return hvd_scenarios(_scenarios)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, init=False, env={"RINGTRAIN_STALL_TIMEOUT": STALL_S}, timeout=100)


def _one_error_everywhere(mine: Any, other: Any, bad: int, kind: str, words: str) -> None:
    assert mine is not None and mine[0] == kind and words in mine[1], mine
    assert other is not None and other[0] == "NegotiationError", other
    assert f"rank {bad}" in other[1] and words in other[1], other


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label", list(_EXPECTED))
def test_a_failing_call_on_one_rank_is_an_error_on_every_rank(world: list[dict[str, Any]], label: str) -> None:
    bad = _CALLS[label][0]
    outs = scenario_results(world, label, after=[1.0, 2.0])
    _one_error_everywhere(outs[bad]["error"], outs[1 - bad]["error"], bad, *_EXPECTED[label])


@pytest.mark.timeout(120)
def test_a_grouped_scalar_on_one_rank_is_an_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    # Before: _GroupedAllgather read its first dimension (IndexError) before submitting.
    outs = scenario_results(world, "grouped_allgather_scalar", after=[1.0, 2.0])
    assert outs[0]["error"] is not None and outs[0]["error"][0] == "HorovodUsageError", outs[0]
    assert outs[1]["error"] is not None and outs[1]["error"][0] == "NegotiationError", outs[1]
    assert "rank-zero" in outs[1]["error"][1], outs[1]


@pytest.mark.timeout(120)
def test_an_empty_named_group_leaves_no_member_pending(world: list[dict[str, Any]]) -> None:
    r0, r1 = scenario_results(world, "named_group_again", after=[1.0, 2.0])
    _one_error_everywhere(r1["first"], r0["first"], 1, "ValueError", "empty list")
    assert r0["again"] == r1["again"] == [[2.0] * 4] * 2


@pytest.mark.timeout(120)
def test_a_process_set_one_rank_cannot_use_is_an_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    r0, r1 = scenario_results(world, "process_sets", after=[1.0, 2.0])
    for key in ("copy", "removed"):
        _one_error_everywhere(r1[key], r0[key], 1, "ConfigError", "not registered")
    _one_error_everywhere(r1["list"], r0["list"], 1, "ValueError", "hvd.ProcessSet")
    assert r0["copy_after"] == r1["copy_after"] == [1.0, 2.0, 2.0]
    assert r0["removed_after"] == r1["removed_after"] == [1.0, 2.0]
