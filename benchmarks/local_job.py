"""Run a function on N local ranks after ``rt.init()``: the local-job helper of the
benchmarks (allreduce.py, step_overhead.py, keras_overlap.py, gpu_check.py).

Each rank is a ``spawn`` process with the launch variables of a one-host job; rank 0's
rendezvous port is reserved with :func:`ringtrain.sockets.reserve` and held until the
job is over, and the ranks are stopped with ringtrain's one stop sequence.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from typing import Any

from ringtrain import sockets
from ringtrain.processes import SpawnedProcess, stop_sequence

__all__ = ["spawn_world"]


def _child(fn: Callable[..., Any], rank: int, n: int, port: int, args: tuple, out: Any,
           env: dict[str, str]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env,
    )
    import torch

    torch.set_num_threads(1)
    import ringtrain as rt

    rt.init()
    try:
        value = fn(*args)
        out.put((rank, True, value))
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        import traceback

        out.put((rank, False, f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        rt.shutdown()


def spawn_world(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 3600,
                env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on n local ranks after ``rt.init()``; results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # Held, not listening, until the job is over: rank 0's store binds the port beside it.
    reservation = sockets.reserve("127.0.0.1", 0)
    port = int(reservation.getsockname()[1])
    procs = [ctx.Process(target=_child, args=(fn, r, n, port, args, out, env or {}), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n:
            try:
                rank, ok, value = out.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    raise RuntimeError(f"ranks {sorted(set(range(n)) - set(got))} did not report") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(10)
        stop_sequence([SpawnedProcess(p) for p in procs], grace=1.0)
        reservation.close()
    return [got[r] for r in range(n)]
