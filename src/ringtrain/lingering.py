"""ringtrain's own daemon threads that can be inside a backend call: joined at exit.

A daemon thread that is inside a torch C++ call (a store ``set``, a Gloo wait) when the
interpreter starts to finalize cannot come back: when the call returns, re-taking the
GIL ends the thread with ``pthread_exit`` inside a C++ destructor, which cannot unwind,
and the whole process aborts ("terminate called without an active exception"). A
thread looping on ``TCPStore.set`` at exit aborts the process 20 times in 20 here. So
each such thread is tracked here, and the runtime's exit handler, which runs before
finalization, asks them to stop and joins them (:func:`settle`). A thread that does
not finish in time is reported, and the process leaves with status 1 instead of
aborting (see ``runtime.membership.Membership._exit_guard``). Leaf module: the standard library only.
"""

from __future__ import annotations

import threading
import time
import weakref

__all__ = ["settle", "track"]

_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_lock = threading.Lock()


def track(thread: threading.Thread) -> threading.Thread:
    """Join ``thread`` at exit (it must end on its own once its owner closed it)."""
    with _lock:
        _threads.add(thread)
    return thread


def settle(timeout: float) -> list[str]:
    """Join every tracked thread that is still alive, within ``timeout`` s in all;
    the names of those that are still running at the deadline."""
    deadline = time.monotonic() + timeout
    with _lock:
        threads = [t for t in _threads if t.is_alive() and t is not threading.current_thread()]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]
