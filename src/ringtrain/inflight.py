"""Keep tensors handed to a backend alive until the backend's threads let go of them.

Found with a core dump of the rare exit abort ("terminate called without an active
exception", 2 runs in 50 under load): a Gloo worker thread finishes an allreduce, the
caller's ``wait()`` returns, the caller drops its tensor, and only then does the
worker destroy its work object. Its reference to the tensor is now the last one, so
releasing it must decref the tensor's Python object and take the GIL; if the
interpreter is finalizing by then, taking the GIL ends the thread with
``pthread_exit`` inside C++ code that may not unwind, and the process aborts.

So every tensor ringtrain passes to a collective is also held here, with the
TensorImpl reference count it had before the call. :func:`drain` (``rt.shutdown()`` and
the runtime's exit handler call it) waits until each is back to that count, i.e. the
backend has let go, and only then are they released, in the calling thread. Holding
costs a deque append; the deque keeps the last few hundred tensors (older ones were
released by the backend long ago). Leaf module: torch only.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

__all__ = ["drain", "hold"]

_held: deque[tuple[torch.Tensor, int]] = deque(maxlen=512)
_lock = threading.Lock()


def _uses(t: torch.Tensor) -> int:
    """References to the tensor's C++ TensorImpl (the Python object counts as one)."""
    return int(t._use_count())  # type: ignore[attr-defined]


def hold(*tensors: torch.Tensor) -> None:
    """Call *before* handing ``tensors`` to the backend (the count taken is the baseline)."""
    with _lock:
        for t in tensors:
            _held.append((t, _uses(t)))


def drain(timeout: float = 2.0) -> bool:
    """Wait (bounded) until the backend released every held tensor, then drop them.
    False if some were still in use at the deadline (they are dropped anyway)."""
    deadline = time.monotonic() + timeout
    with _lock:
        items = list(_held)
        _held.clear()
    pending = [(t, base) for t, base in items if _uses(t) > base]
    while pending and time.monotonic() < deadline:
        time.sleep(0.001)  # lets a descheduled worker thread run (and take the GIL)
        pending = [(t, base) for t, base in pending if _uses(t) > base]
    return not pending
