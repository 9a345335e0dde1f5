"""ringtrain.horovod's collectives against Horovod's semantics, fourth audit: a sparse
tensor, or a lazily conjugated or negated view, on one rank only; 16- and 32-bit
integer reductions the backend lacks; complex reductions without an order; objects one
rank cannot pickle. One 2-rank world runs every scenario (each records what it saw,
and whether the ranks were still in step after it); the tests read it. Each test failed
before its fix (the comment says how)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from ringtest import error_of, hvd_scenarios, run_world, scenario_results

#: Short enough that a scenario which stalls (as they did before their fixes) fails the
#: world quickly, long enough for a loaded 2-core machine.
STALL_S = "6"


_error = error_of


def _in_step(hvd: Any, tag: str) -> float:
    """An allreduce after the scenario: 1.0 when every rank is still in step."""
    return float(hvd.allreduce(torch.full((1,), float(hvd.rank())), op=hvd.Sum, name=f"step.{tag}").item())


def _int16(hvd: Any) -> dict[str, Any]:
    r = hvd.rank()
    out: dict[str, Any] = {}
    for dtype in (torch.int16, torch.uint16, torch.uint32):
        x = torch.tensor([30000 + r, 7 - r, 3], dtype=torch.int64).to(dtype)
        out[str(dtype)] = [
            hvd.allreduce(x, op=hvd.Sum, name=f"s.{dtype}").tolist(),
            hvd.allreduce(x, op=hvd.Min, name=f"m.{dtype}").tolist(),
            hvd.allreduce(x, op=hvd.Product, postscale_factor=0.5, name=f"p.{dtype}").tolist(),
            hvd.reducescatter(x[:2], op=hvd.Sum, name=f"rs.{dtype}").tolist(),
        ]
    out["after"] = _in_step(hvd, "int16")
    return out


def _complex(hvd: Any) -> dict[str, Any]:
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    out: dict[str, Any] = {op: _error(lambda op=op: hvd.allreduce(c, op=getattr(hvd, op), name=f"c.{op}"))
                           for op in ("Product", "Max", "Min")}
    out["sum"] = hvd.allreduce(c, op=hvd.Sum, name="c.sum").tolist()
    out["after"] = _in_step(hvd, "complex")
    return out


def _views(hvd: Any) -> dict[str, Any]:
    r = hvd.rank()
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    ones = torch.ones(2) * (r + 1)
    out = {
        # only the root's tensor is a conjugate view
        "broadcast": hvd.broadcast(c.conj() if r == 0 else torch.zeros(2, dtype=torch.complex64), 0,
                                   name="v.b").tolist(),
        # only rank 1's is a negative view
        "allgather": hvd.allgather(torch._neg_view(ones) if r == 1 else ones, name="v.g").tolist(),
        "allreduce": hvd.allreduce(torch._neg_view(ones) if r == 0 else ones, op=hvd.Sum, name="v.r").tolist(),
    }
    out["after"] = _in_step(hvd, "views")
    return out


def _objects(hvd: Any) -> dict[str, Any]:
    r = hvd.rank()
    out: dict[str, Any] = {
        "broadcast": _error(lambda: hvd.broadcast_object(threading.Lock() if r == 1 else None, root_rank=1)),
        "allgather": _error(lambda: hvd.allgather_object(threading.Lock() if r == 0 else r)),
        "fine": hvd.allgather_object(r * 10),
    }
    out["after"] = _in_step(hvd, "objects")
    return out


def _sparse(hvd: Any) -> dict[str, Any]:
    r = hvd.rank()
    dense = torch.tensor([1.0, 0.0, 2.0, 0.0]) * (r + 1)
    out: dict[str, Any] = {
        "allreduce": _error(lambda: hvd.allreduce(dense.to_sparse() if r == 1 else dense, op=hvd.Sum, name="x.r")),
        "grouped": _error(lambda: hvd.grouped_allreduce([dense, dense.to_sparse() if r == 0 else dense], name="x.g")),
        "broadcast": _error(lambda: hvd.broadcast(dense.to_sparse() if r == 0 else dense, 0, name="x.b")),
        "allgather": _error(lambda: hvd.allgather(dense.to_sparse() if r == 1 else dense, name="x.a")),
        "reducescatter": _error(lambda: hvd.reducescatter(dense.to_sparse() if r == 0 else dense, name="x.s")),
    }
    out["after"] = _in_step(hvd, "sparse")
    return out


def _scenarios(hvd: Any) -> list[tuple[str, Any]]:
    # Those that put the ranks out of step before their fixes come last.
    return [("int16", lambda: _int16(hvd)), ("complex", lambda: _complex(hvd)),
            ("views", lambda: _views(hvd)), ("objects", lambda: _objects(hvd)),
            ("sparse", lambda: _sparse(hvd))]


def _world() -> dict[str, Any]:
    return hvd_scenarios(_scenarios)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, init=False, env={"RINGTRAIN_STALL_TIMEOUT": STALL_S}, timeout=100)


def _scenario(world: list[dict[str, Any]], label: str) -> list[Any]:
    return scenario_results(world, label, after=1.0)


@pytest.mark.timeout(120)
def test_int16_uint16_uint32_reductions_wrap_as_the_dtype(world: list[dict[str, Any]]) -> None:
    # Before: Sum, Min, Product and reducescatter of int16 (documented as supported)
    # failed on every rank with Gloo's "Invalid scalar type", as a recoverable
    # HorovodInternalError. Rank r holds [30000 + r, 7 - r, 3].
    for o in _scenario(world, "int16"):
        for dtype, wrapped in (("torch.int16", 60001 - 2 ** 16), ("torch.uint16", 60001), ("torch.uint32", 60001)):
            total, low, prod, share = o[dtype]
            assert total == [wrapped, 13, 6], dtype
            assert low == [30000, 6, 3], dtype
            # the product is taken in the dtype, then halved: (30000 * 30001) mod 2**bits / 2
            bits = 16 if "16" in dtype else 32
            full = (30000 * 30001) % 2 ** bits
            if dtype == "torch.int16" and full >= 2 ** 15:
                full -= 2 ** 16
            assert prod == [int(full * 0.5), 21, 4], dtype
            assert share in ([wrapped], [13]), dtype


@pytest.mark.timeout(120)
def test_complex_min_max_product_are_refused_at_the_call(world: list[dict[str, Any]]) -> None:
    # Before: they failed inside the coordinator on every rank, after the negotiation,
    # as a recoverable HorovodInternalError (Gloo has no complex order or product).
    for o in _scenario(world, "complex"):
        for op in ("Product", "Max", "Min"):
            kind, text = o[op]
            assert kind == "ValueError" and f"op=hvd.{op}" in text and "view_as_real" in text, (op, kind, text)
        assert o["sum"] == [2 + 4j, 6 - 8j]


@pytest.mark.timeout(120)
def test_conjugate_and_negative_views_on_one_rank_give_their_values(world: list[dict[str, Any]]) -> None:
    # Before: view(uint8) refused the root's x.conj() (and a torch._neg_view) inside the
    # coordinator, on that rank only, after the negotiation; the other rank waited in the
    # backend for it, and every later operation stalled.
    for o in _scenario(world, "views"):
        assert o["broadcast"] == [1 - 2j, 3 + 4j]
        assert o["allgather"] == [1.0, 1.0, -2.0, -2.0]
        assert o["allreduce"] == [1.0, 1.0]  # -1 + 2


@pytest.mark.timeout(120)
def test_an_object_one_rank_cannot_pickle_is_an_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    # Before: the rank that could not pickle raised, and the others waited for its size
    # for ever (without a stall limit, Horovod's default) or until the stall limit.
    r0, r1 = _scenario(world, "objects")
    assert r1["broadcast"][0] == "TypeError"  # the root's own error, as Horovod's
    assert r0["broadcast"][0] == "NegotiationError" and "root (rank 1) cannot pickle" in r0["broadcast"][1]
    assert r0["allgather"][0] == "TypeError"
    assert r1["allgather"][0] == "NegotiationError" and "rank 0 cannot pickle" in r1["allgather"][1]
    assert r0["fine"] == r1["fine"] == [0, 10]


@pytest.mark.timeout(120)
def test_a_sparse_tensor_on_one_rank_is_one_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    # Before: it failed inside the coordinator on its rank only (reshape/view of a sparse
    # tensor), after the negotiation: the other rank waited in the backend for it, and
    # every later operation stalled. Horovod refuses a sparse tensor with a ValueError.
    r0, r1 = _scenario(world, "sparse")
    holder = {"allreduce": 1, "grouped": 0, "broadcast": 0, "allgather": 1, "reducescatter": 0}
    for call, rank in holder.items():
        mine, other = (r0, r1) if rank == 0 else (r1, r0)
        assert mine[call] is not None and mine[call][0] == "ValueError", (call, mine[call])
        assert other[call] is not None and other[call][0] == "NegotiationError", (call, other[call])
        assert other[call][1] == mine[call][1], call
        assert f"on rank {rank}" in mine[call][1] and "to_dense()" in mine[call][1], mine[call][1]
