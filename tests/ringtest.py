"""Run a function on N real processes joined by Gloo over loopback, with a deadline.

``run_world(fn, n, *args)`` spawns n fresh interpreters, each with the torchrun-style
environment of one rank, calls ``rt.init()`` then ``fn(*args)`` and returns the list
of results by rank. A rank that raises fails the call with its traceback; a world that
does not finish within ``timeout`` is killed (every process, no orphans) and fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["WorldFailed", "free_port", "run_world"]


class WorldFailed(AssertionError):
    """One or more ranks raised, or the world timed out."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, n: int, port: int, args: tuple, env: dict[str, str],
           init: bool, results: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        import ringtrain as rt

        if init:
            rt.init()
        value = fn(*args)
        # Plain pickle copies tensor data; the queue's own pickler would pass file
        # descriptors that vanish when this process exits.
        results.put((rank, True, pickle.dumps(value)))
        if init:
            rt.shutdown()
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_world(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 60.0,
              env: dict[str, str] | None = None, init: bool = True,
              expect_failure: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``n`` ranks; results by rank (or the error texts if expect_failure)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, n, port, args, env or {}, init, results), daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 0.5))
                got[rank] = (ok, pickle.loads(value) if ok else value)
            except queue.Empty:
                # A rank that died without reporting (e.g. os._exit) counts as done.
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if len(got) == n else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = {r: v for r, (ok, v) in got.items() if not ok}
    missing = [r for r in range(n) if r not in got]
    if expect_failure:
        return [got.get(r, (False, "no report (exited or timed out)"))[1] for r in range(n)]
    if errors or missing:
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        if missing:
            text += f"\nranks {missing} did not report within {timeout:.0f}s"
        raise WorldFailed(text, errors)
    return [got[r][1] for r in range(n)]
