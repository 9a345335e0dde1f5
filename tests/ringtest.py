"""Run a function on N real processes joined by Gloo over loopback, with a deadline.

``run_world(fn, n, *args)`` starts n processes, each with the torchrun-style
environment of one rank, calls ``rt.init()`` then ``fn(*args)`` and returns the list
of results by rank. A rank that raises fails the call with its traceback; a world that
does not finish within ``timeout`` is killed (every process, no orphans) and fails.

The ranks are forked from a fork server that imported torch and ringtrain once, when
the suite first needed it (``multiprocessing``'s "forkserver" start method with
preloaded modules): a fresh interpreter importing torch costs 1-3 s on the 2-core test
machine, a fork of the warm server about 20 ms, and each rank still starts from a
process that has run nothing but those imports (no test's state, no threads, no
process group). What a spawned rank would have inherited from the test process is
passed along explicitly: its environment and ``sys.path``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["World", "WorldFailed", "error_of", "free_port", "hvd_scenarios", "run_scenarios", "run_world", "scenario_results",
           "start_world"]


class WorldFailed(AssertionError):
    """One or more ranks raised, or the world timed out."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What every rank imports anyway (torch._dynamo: on the first optimizer step, ~1 s);
# the fork server imports it once for all of them.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "ringtrain", "ringtrain.wiring", "ringtrain.runtime",
           "ringtrain.collectives", "ringtrain.optimizer", "ringtrain.replicate", "ringtest"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(payload: bytes, rank: int, n: int, port: int, environ: dict[str, str], path: list[str],
           init: bool, results: Any) -> None:
    # The fork server's environment and sys.path are those of the moment it started;
    # the rank gets the test process's current ones, as a spawned rank would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    sys.path[:] = path
    try:
        fn, args, env = pickle.loads(payload)
        os.environ.update(env)
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


class World:
    """n ranks started by :func:`start_world`; :meth:`results` waits for them."""

    def __init__(self, fn: Callable[..., Any], n: int, args: tuple, timeout: float,
                 env: dict[str, str] | None, init: bool, expect_failure: bool) -> None:
        ctx = _context()
        self.n, self.timeout, self.expect_failure = n, timeout, expect_failure
        self._queue = ctx.Queue()
        port = free_port()
        payload = pickle.dumps((fn, args, env or {}))
        environ = dict(os.environ)
        self._procs = [
            ctx.Process(target=_child, args=(payload, r, n, port, environ, list(sys.path), init, self._queue),
                        daemon=True)
            for r in range(n)
        ]
        self._deadline = time.monotonic() + timeout
        for p in self._procs:
            p.start()

    def results(self) -> list[Any]:
        """Results by rank (the error texts if expect_failure); raises WorldFailed."""
        n, procs = self.n, self._procs
        got: dict[int, tuple[bool, Any]] = {}
        try:
            while len(got) < n:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, ok, value = self._queue.get(timeout=min(left, 0.5))
                    got[rank] = (ok, pickle.loads(value) if ok else value)
                except queue.Empty:
                    # A rank that died without reporting (e.g. os._exit) counts as done.
                    if all(not p.is_alive() for p in procs) and self._queue.empty():
                        break
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, self._deadline - time.monotonic())) if len(got) == n else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        errors = {r: v for r, (ok, v) in got.items() if not ok}
        missing = [r for r in range(n) if r not in got]
        if self.expect_failure:
            return [got.get(r, (False, "no report (exited or timed out)"))[1] for r in range(n)]
        if errors or missing:
            text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            if missing:
                text += f"\nranks {missing} did not report within {self.timeout:.0f}s"
            raise WorldFailed(text, errors)
        return [got[r][1] for r in range(n)]


def start_world(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 60.0,
                env: dict[str, str] | None = None, init: bool = True,
                expect_failure: bool = False) -> World:
    """Start ``fn(*args)`` on ``n`` ranks and return at once: worlds that mostly wait
    (on a stall timeout, a rank that never comes) can wait side by side."""
    return World(fn, n, args, timeout, env, init, expect_failure)


def run_world(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 60.0,
              env: dict[str, str] | None = None, init: bool = True,
              expect_failure: bool = False) -> list[Any]:
    """Run ``fn(*args)`` on ``n`` ranks; results by rank (or the error texts if expect_failure)."""
    return start_world(fn, n, *args, timeout=timeout, env=env, init=init,
                       expect_failure=expect_failure).results()


def run_scenarios(scenarios: Sequence[tuple[str, Callable[[], Any]]]) -> dict[str, Any]:
    """In a rank: each scenario's result by label, or its error as text, so that one
    failing scenario of a shared world does not hide the others (order them so those
    that can leave the ranks out of step run last)."""
    out: dict[str, Any] = {}
    for label, scenario in scenarios:
        try:
            out[label] = scenario()
        except Exception as exc:  # noqa: BLE001 - the test of that scenario reports it
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def scenario_results(world: list[dict[str, Any]], label: str, after: Any = None) -> list[Any]:
    """Every rank's result of scenario ``label`` (see :func:`run_scenarios`); fails with the
    first rank's error text if one raised. ``after``: what each result's ``"after"`` entry
    must be (a collective run after the scenario: the ranks are still in step)."""
    outs = [o[label] for o in world]
    for rank, o in enumerate(outs):
        assert not isinstance(o, str), f"rank {rank}: {o}"
        if after is not None:
            assert o["after"] == after, (rank, o)
    return outs


def hvd_scenarios(scenarios: Callable[[Any], Sequence[tuple[str, Callable[[], Any]]]]) -> dict[str, Any]:
    """In a rank: ``ringtrain.horovod`` started, ``scenarios(hvd)`` run (see
    :func:`run_scenarios`), and shut down."""
    import ringtrain.horovod as hvd

    hvd.init()
    out = run_scenarios(scenarios(hvd))
    hvd.shutdown()
    return out


def error_of(call: Callable[[], Any]) -> tuple[str, str] | None:
    """(exception class, message) of what ``call()`` raised, or None."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the tests judge the class and the text
        return type(exc).__name__, str(exc)
    return None
