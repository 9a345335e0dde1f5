"""``hvd.elastic``: Horovod's elastic API on ringtrain's restart and resize machinery.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    train(state)

Under ``horovodrun``/``ringrun --min-np M --max-np N`` (a resizable job) the job
changes size in place, as Horovod's does: when a rank or host dies the others' next
collective fails with :class:`HorovodInternalError`; ``run`` restores the last commit
(in memory, no disk), leaves the broken world, joins the smaller one ringrun forms,
calls the reset callbacks (``hvd.size()`` is the new size there) and syncs the state
from rank 0. When the discovery script reports new hosts, ``state.commit()`` raises
:class:`HostsUpdatedInterrupt` on every rank at the same commit and the job moves to
the larger world; the new ranks get the state by the sync. The engine is
:func:`ringtrain.elastic.drive`.

In a fixed-size job (``--max-restarts K``) a failure ends the job; ringrun restarts it
and ``run`` resumes from the last commit that rank 0 persisted (see ``state``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ringtrain.horovod.elastic.sampler import ElasticSampler
from ringtrain.horovod.elastic.state import HostsUpdatedInterrupt, ObjectState, State, TorchState

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]

log = logging.getLogger("ringtrain.horovod.elastic")

T = TypeVar("T")


def _leave(sever: Callable[[], object]) -> None:
    """Leave a world that changed without waiting for its ranks (some may be gone)."""
    from ringtrain import runtime
    from ringtrain.horovod import basics

    eng = basics._engine  # the facade's own coordinator; ending it is this module's job
    if eng is not None:
        eng.abort("the job changed size", sever=sever)
    else:
        sever()
    runtime.abandon()  # the groups go now; hvd.shutdown() then finds nothing to wait for
    basics.shutdown()


def _join() -> None:
    from ringtrain.horovod import basics, handles

    # Unnamed operations are numbered from 0 in every world: the ranks that join a
    # running job start counting there too.
    handles._counters.clear()
    basics.init()


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Run ``func(state, ...)`` elastically (see the module doc)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        from ringtrain import elastic, runtime
        from ringtrain.horovod.basics import init, is_initialized

        if not is_initialized():
            init()
        if elastic.resizable():
            # Every world starts from rank 0's state: the first, and for a rank that
            # joins a running job, the one it joins.
            try:
                return elastic.drive(lambda: func(state, *args, **kwargs), state, _leave, _join, state.sync)
            except BaseException as exc:
                if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
                    # This rank fails (the script's own error): it leaves the world without
                    # the collective shutdown, which would wait on ranks that go on
                    # without it; ringrun re-forms the others.
                    _leave(lambda: None)
                raise
        # Horovod's order after a reset: the callbacks, then the sync (what a callback
        # changes on one rank is then rank 0's on every rank).
        if state.resume_from_disk():
            log.warning("resumed from the last commit after a restart (attempt %d)",
                        runtime.world().env.attempt)
            state.on_reset()
        state.sync()
        while True:
            try:
                result = func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                state.on_reset()
                if not exc.skip_sync:
                    state.sync()
                continue
            state.forget_persisted()  # finished: a later job must not resume from it
            return result

    return wrapper
