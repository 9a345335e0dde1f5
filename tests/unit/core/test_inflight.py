"""ringtrain.inflight: every tensor handed to a backend is held until the backend lets
go of it, so no Gloo thread drops the last reference while the interpreter finalizes
(the exit abort "terminate called without an active exception")."""

from __future__ import annotations

import ast
import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch
from ringtest import run_world

from ringtrain import inflight

SRC = Path(__file__).resolve().parents[3] / "src" / "ringtrain"

# torch.distributed calls that hand tensors to the backend.
_TENSOR_CALLS = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_to_all",
    "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather",
    "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
}
# Their object versions make the tensors inside torch, where nothing can hold them.
_OBJECT_CALLS = {"all_gather_object", "broadcast_object_list", "gather_object",
                 "scatter_object_list", "send_object_list", "recv_object_list"}
# The calibration processes destroy their own process group before they exit (which
# joins Gloo's threads), so nothing of theirs is left for finalization.
_OWN_GROUP = {"plan/calibrate.py"}


def _dist_calls(fn: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "dist"]


def _holds(fn: ast.AST) -> list[int]:
    return [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "hold" and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "inflight"]


def test_every_collective_in_the_library_hands_over_held_tensors() -> None:
    unheld: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in _OWN_GROUP or rel == "inflight.py":
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            holds = _holds(fn)
            for call in _dist_calls(fn):
                name = call.func.attr  # type: ignore[attr-defined]
                where = f"{rel}:{call.lineno} dist.{name}"
                if name in _OBJECT_CALLS:
                    unheld.append(f"{where} (use inflight.gather_objects)")
                elif name in _TENSOR_CALLS and not any(line <= call.lineno for line in holds):
                    unheld.append(f"{where} (no inflight.hold before it)")
    assert unheld == []


def test_holding_keeps_only_what_is_in_flight() -> None:
    inflight.drain()
    refs = []
    for _ in range(50):
        t = torch.ones(1024)
        refs.append(weakref.ref(t))
        inflight.hold(t)
        del t  # nothing else holds it: "the backend" let go at once
    gc.collect()
    # Each hold let go of this thread's released tensors: only the last is kept.
    assert sum(r() is not None for r in refs) == 1
    inflight.drain()
    assert all(r() is None for r in refs)


def test_a_tensor_another_thread_has_not_handed_over_yet_is_kept() -> None:
    inflight.drain()
    held = threading.Event()
    go_on = threading.Event()
    ref: list[weakref.ref] = []

    def other() -> None:
        t = torch.ones(8)
        ref.append(weakref.ref(t))
        inflight.hold(t)  # ... and the backend call would come next
        del t
        held.set()
        go_on.wait(10)

    worker = threading.Thread(target=other)
    worker.start()
    try:
        assert held.wait(10)
        inflight.hold(torch.ones(8))  # this thread's hold must not drop the other's
        gc.collect()
        assert ref[0]() is not None
    finally:
        go_on.set()
        worker.join(10)
    assert inflight.drain()
    assert ref[0]() is None


def _gather_mixed() -> list[object]:
    import torch.distributed as dist

    from ringtrain import runtime

    rank = runtime.rank()
    mine = {"rank": rank, "payload": "x" * (10 + 1000 * rank), "t": torch.arange(rank + 1)}
    everyone = inflight.gather_objects(mine)
    pair = dist.new_group([0, 1], backend="gloo")
    firsts = inflight.gather_objects(rank * 10, group=pair) if rank < 2 else None
    return [everyone, firsts]


@pytest.mark.timeout(120)
def test_gather_objects_returns_every_ranks_object_in_rank_order() -> None:
    results = run_world(_gather_mixed, 3, timeout=100)
    for everyone, _ in results:
        assert [o["rank"] for o in everyone] == [0, 1, 2]
        assert [len(o["payload"]) for o in everyone] == [10, 1010, 2010]
        assert [o["t"].tolist() for o in everyone] == [[0], [0, 1], [0, 1, 2]]
    assert [r[1] for r in results] == [[0, 10], [0, 10], None]
