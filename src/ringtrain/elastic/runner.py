"""``rt.elastic.run``: resume a :class:`~ringtrain.elastic.resume.Resumable` state, then
train in the resize loop (:func:`~ringtrain.elastic.resize.drive`).

It calls ``rt.init()`` (the composition root, :mod:`ringtrain.wiring`) for the worlds it
joins, as ``hvd.elastic.run`` calls ``hvd.init()``: the elastic entry points sit above
the layers they wire.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ringtrain import runtime, wiring
from ringtrain.elastic.resize import drive, leave_world, resizable, world_version
from ringtrain.elastic.resume import Resumable

__all__ = ["run"]

T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Run ``func(state, ...)`` with a :class:`Resumable` ``state`` elastically: resumed
    from its checkpoint at the start, moved to ringrun's next world in place when the job
    resizes (see the module doc). In a fixed-size job it just resumes and calls ``func``."""

    @functools.wraps(func)
    def wrapper(state: Resumable, *args: Any, **kwargs: Any) -> T:
        def join() -> None:
            wiring.init()

        def start() -> None:
            if not runtime.is_initialized():
                wiring.init()
            if world_version() == 0:
                state.resume()
            else:
                state.sync()  # a worker that joins a running job: rank 0's state
            state.commit(state.step)

        try:
            return drive(lambda: func(state, *args, **kwargs), state, leave_world, join, start)
        except BaseException as exc:
            if resizable() and runtime.is_initialized() and not (
                    isinstance(exc, SystemExit) and exc.code in (0, None)):
                # This rank fails: leave without waiting on the ranks that go on without it.
                leave_world(lambda: None)
            raise

    return wrapper
