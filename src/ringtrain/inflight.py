"""What is inside a backend call right now: ringtrain's tensors handed to one and its
threads waiting in one. Both must be let go before the interpreter finalizes.

**Tensors.** Found with a core dump of the rare exit abort ("terminate called without
an active exception", 2 runs in 50 under load): a Gloo worker thread finishes an
allreduce, the caller's ``wait()`` returns, the caller drops its tensor, and only then
does the worker destroy its work object. Its reference to the tensor is now the last
one, so releasing it must decref the tensor's Python object and take the GIL; if the
interpreter is finalizing by then, taking the GIL ends the thread with ``pthread_exit``
inside C++ code that may not unwind, and the process aborts.

So every tensor ringtrain passes to a collective is also held here (:func:`hold`), with
the TensorImpl reference count it had before the call. :func:`drain` (``rt.shutdown()``
and the runtime's exit handler call it) waits until each is back to that count, i.e.
the backend has let go, and only then are they released, in the calling thread. Each
hold first drops the calling thread's tensors the backend has let go of since (so a job
keeps only what is in flight, not hundreds of fused buffers); the deque keeps at most a
few hundred. torch's own object collectives (``all_gather_object``,
``broadcast_object_list``) make their tensors inside torch, where nothing can hold
them: :func:`gather_objects` is the held replacement every layer uses.

**Threads.** A daemon thread that is inside a torch C++ call (a store ``set``, a Gloo
wait) when the interpreter starts to finalize cannot come back the same way: a thread
looping on ``TCPStore.set`` at exit aborts the process 20 times in 20 here. So each such
thread is tracked (:func:`track`), and the runtime's exit handler, which runs before
finalization, asks them to stop and joins them (:func:`settle`). A thread that does not
finish in time is reported, and the process leaves with status 1 instead of aborting
(see ``runtime.membership.Membership._exit_guard``).

Leaf module: torch only.
"""

from __future__ import annotations

import pickle
import threading
import time
import weakref
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["drain", "gather_objects", "hold", "settle", "track"]

_held: deque[tuple[torch.Tensor, int, int]] = deque(maxlen=512)  # (tensor, base, thread)
_lock = threading.Lock()


def _uses(t: torch.Tensor) -> int:
    """References to the tensor's C++ TensorImpl (the Python object counts as one)."""
    return int(t._use_count())  # type: ignore[attr-defined]


def hold(*tensors: torch.Tensor) -> None:
    """Call *before* handing ``tensors`` to the backend (the count taken is the baseline)."""
    with _lock:
        me = threading.get_ident()
        if _held:
            # Let go (here, in a thread that may take the GIL) of what the backend
            # released since: only tensors still in flight need keeping. Only this
            # thread's: its earlier calls have returned, so the backend took its
            # references then; another thread's tensor may be held but not handed over yet.
            kept = [e for e in _held if e[2] != me or _uses(e[0]) > e[1]]
            _held.clear()
            _held.extend(kept)
        for t in tensors:
            _held.append((t, _uses(t), me))


def drain(timeout: float = 2.0) -> bool:
    """Wait (bounded) until the backend released every held tensor, then drop them.
    False if some were still in use at the deadline (they are dropped anyway)."""
    deadline = time.monotonic() + timeout
    with _lock:
        items = list(_held)
        _held.clear()
    pending = [(t, base) for t, base, _ in items if _uses(t) > base]
    while pending and time.monotonic() < deadline:
        time.sleep(0.001)  # lets a descheduled worker thread run (and take the GIL)
        pending = [(t, base) for t, base in pending if _uses(t) > base]
    return not pending


def gather_objects(obj: Any, group: Any = None, device: torch.device | None = None) -> list[Any]:
    """Every member's ``obj`` (pickled), by group rank: ``dist.all_gather_object`` with
    tensors held here. ``device``: where the bytes travel (NCCL moves only CUDA tensors;
    default the CPU)."""
    n = dist.get_world_size(group)
    if n == 1:
        return [obj]
    where = device if device is not None else torch.device("cpu")
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(where)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=where)
    sizes = [torch.zeros(1, dtype=torch.int64, device=where) for _ in range(n)]
    hold(size, *sizes)
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=where)
    padded[: data.numel()] = data
    outs = [torch.empty(longest, dtype=torch.uint8, device=where) for _ in range(n)]
    hold(padded, *outs)
    dist.all_gather(outs, padded, group=group)
    return [pickle.loads(out[:length].cpu().numpy().tobytes())
            for out, length in zip(outs, lengths, strict=True)]


# -- threads inside a backend call -------------------------------------------------------------

_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_threads_lock = threading.Lock()


def track(thread: threading.Thread) -> threading.Thread:
    """Join ``thread`` at exit (it must end on its own once its owner closed it)."""
    with _threads_lock:
        _threads.add(thread)
    return thread


def settle(timeout: float) -> list[str]:
    """Join every tracked thread that is still alive, within ``timeout`` s in all;
    the names of those that are still running at the deadline."""
    deadline = time.monotonic() + timeout
    with _threads_lock:
        threads = [t for t in _threads if t.is_alive() and t is not threading.current_thread()]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]
