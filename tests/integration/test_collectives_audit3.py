"""Collectives audit: results that were silently wrong, and calls that left the ranks out
of step, on one 3-rank Gloo world shared by the module (each case against the exact
answer computed from every rank's input)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ringtest import run_world

N = 3


def _case(fn: Callable[[], Any]) -> tuple[str, Any]:
    import ringtrain as rt

    try:
        return ("ok", fn())
    except rt.errors.RingtrainError as exc:
        return (type(exc).__name__, str(exc))
    except Exception as exc:  # noqa: BLE001 - the old behaviour, to be reported
        return (type(exc).__name__, str(exc))


def _world() -> dict[str, tuple[str, Any]]:
    import ringtrain as rt

    r = rt.rank()
    out: dict[str, tuple[str, Any]] = {}
    nine = (2,) + (1,) * 7 + (3,)  # one dimension more than a header carries verbatim
    out["allgather_9d"] = _case(lambda: rt.allgather(torch.full(nine, float(r))))
    out["allgather_9d_uneven"] = _case(lambda: rt.allgather(torch.full((r + 1, *nine[1:]), float(r))))
    out["alltoall_9d_uneven"] = _case(lambda: rt.alltoall(
        torch.full((N * (r + 1), *nine[1:]), float(r)), splits=[r + 1] * N))
    for algo in ("native", "ring", "ps"):
        out[f"int8_average_{algo}"] = _case(lambda a=algo: rt.allreduce(  # type: ignore[misc]
            torch.full((3,), 100 + r, dtype=torch.int8), algorithm=a))
        out[f"fp16_average_{algo}"] = _case(lambda a=algo: rt.allreduce(  # type: ignore[misc]
            torch.full((3,), 30000.0, dtype=torch.float16), algorithm=a))
        out[f"bool_average_{algo}"] = _case(lambda a=algo: rt.allreduce(  # type: ignore[misc]
            torch.ones(2, dtype=torch.bool), algorithm=a))
    out["uint8_average_inplace"] = _case(lambda: rt.allreduce_(
        torch.full((2, 2), 200 + r, dtype=torch.uint8).t()))
    out["int8_reducescatter_average"] = _case(lambda: rt.reducescatter(torch.full((N,), 100 + r, dtype=torch.int8)))
    out["fp16_reducescatter_average"] = _case(lambda: rt.reducescatter(torch.full((N,), 30000.0, dtype=torch.float16)))
    out["complex_min_native"] = _case(lambda: rt.allreduce(torch.ones(2, dtype=torch.complex64), op=rt.Min))
    out["alltoall_scalar"] = _case(lambda: rt.alltoall(torch.tensor(1.0)))
    out["expanded_allreduce_"] = _case(lambda: rt.allreduce_(torch.full((1, 3), float(r)).expand(2, 3), op=rt.Sum))
    out["expanded_broadcast_"] = _case(lambda: rt.broadcast_(torch.full((1, 3), float(r)).expand(2, 3)))
    # Cases that left the ranks out of step before the fix come last.
    out["broadcast_object_unpicklable"] = _case(lambda: rt.broadcast_object(threading.Lock() if r == 0 else None))
    out["broadcast_object_bad_root"] = _case(lambda: rt.broadcast_object("x", root_rank=7 if r == 1 else 0))
    out["allgather_object_unpicklable"] = _case(lambda: rt.allgather_object(threading.Lock() if r == 2 else r))
    # Ring: a complex Min failed on the exchange thread of one rank and stalled the others.
    out["complex_min_ring"] = _case(lambda: rt.allreduce(torch.ones(2, dtype=torch.complex64), op=rt.Min,
                                                          algorithm="ring"))
    out["after"] = _case(lambda: [rt.allreduce(torch.ones(1), op=rt.Sum, algorithm=a).item()
                                  for a in ("native", "ring")])
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, tuple[str, Any]]]:
    return run_world(_world, N, timeout=80, env={"RINGTRAIN_STALL_TIMEOUT": "8"})


def _ok(world: list[dict[str, tuple[str, Any]]], case: str) -> list[Any]:
    results = [w[case] for w in world]
    assert all(kind == "ok" for kind, _ in results), (case, results)
    return [value for _, value in results]


def _same_error(world: list[dict[str, tuple[str, Any]]], case: str, error: str, *words: str) -> None:
    results = [w[case] for w in world]
    assert all(kind == error for kind, _ in results), (case, results)
    assert len({msg for _, msg in results}) == 1, (case, results)  # worded alike on every rank
    assert "\n" not in results[0][1] and all(w in results[0][1] for w in words), (case, results[0])


@pytest.mark.timeout(90)
def test_allgather_and_alltoall_of_more_than_eight_dims(world) -> None:  # type: ignore[no-untyped-def]
    # Before: the header hashed the whole shape, so the first dimension read as 0 and
    # allgather returned an empty tensor; uneven first dimensions were a MismatchError.
    nine = (1,) * 7 + (3,)
    for got in _ok(world, "allgather_9d"):
        assert torch.equal(got, torch.cat([torch.full((2, *nine), float(k)) for k in range(N)]))
    for got in _ok(world, "allgather_9d_uneven"):
        assert torch.equal(got, torch.cat([torch.full((k + 1, *nine), float(k)) for k in range(N)]))
    for r, got in enumerate(_ok(world, "alltoall_9d_uneven")):
        assert torch.equal(got, torch.cat([torch.full((k + 1, *nine), float(k)) for k in range(N)])), r


@pytest.mark.timeout(90)
@pytest.mark.parametrize("algo", ["native", "ring", "ps"])
def test_averages_whose_sum_leaves_the_dtype(world, algo: str) -> None:  # type: ignore[no-untyped-def]
    # Before: int8 100, 101, 102 averaged to 15 (the sum wrapped) and float16 30000 to inf.
    for got in _ok(world, f"int8_average_{algo}"):
        assert got.dtype == torch.int8 and got.tolist() == [101] * 3
    for got in _ok(world, f"fp16_average_{algo}"):
        assert got.dtype == torch.float16 and got.tolist() == [30000.0] * 3


@pytest.mark.timeout(90)
def test_small_dtype_averages_in_place_and_in_reducescatter(world) -> None:  # type: ignore[no-untyped-def]
    for got in _ok(world, "uint8_average_inplace"):
        assert got.dtype == torch.uint8 and got.tolist() == [[201, 201], [201, 201]]  # 603 // 3
    for got in _ok(world, "int8_reducescatter_average"):
        assert got.tolist() == [101]
    for got in _ok(world, "fp16_reducescatter_average"):
        assert got.tolist() == [30000.0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("algo", ["native", "ring", "ps"])
def test_bool_average_is_refused_on_every_rank(world, algo: str) -> None:  # type: ignore[no-untyped-def]
    # Before: every rank True averaged to False (the bool sum is an OR, divided by 3).
    _same_error(world, f"bool_average_{algo}", "ConfigError", "ranks 0, 1, 2", "bool", "rt.Max")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["complex_min_native", "complex_min_ring"])
def test_complex_min_is_one_error_on_every_rank(world, case: str) -> None:  # type: ignore[no-untyped-def]
    # Before: torch's ValueError under native; under ring one rank's exchange thread
    # failed and the others stalled (later ring exchanges too).
    _same_error(world, case, "ConfigError", "complex")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("case", "words"), [
    ("alltoall_scalar", ["scalar"]),  # an IndexError before
    ("expanded_allreduce_", ["share memory", "clone()"]),  # torch's RuntimeError after the exchange
    ("expanded_broadcast_", ["share memory", "clone()"]),
    ("broadcast_object_unpicklable", ["root rank 0", "cannot pickle"]),  # rank 0 alone raised
    ("broadcast_object_bad_root", ["rank 1: root_rank 7"]),  # rank 1 alone raised
    ("allgather_object_unpicklable", ["on rank 2", "cannot pickle"]),  # rank 2 alone raised
])
def test_bad_calls_are_the_same_error_on_every_rank(world, case: str, words: list[str]) -> None:  # type: ignore[no-untyped-def]
    _same_error(world, case, "ConfigError", *words)


@pytest.mark.timeout(90)
def test_world_is_in_step_after_every_error(world) -> None:  # type: ignore[no-untyped-def]
    assert _ok(world, "after") == [[float(N), float(N)]] * N
