"""``hvd.elastic``: Horovod's elastic API on ringtrain's restart and resume machinery.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    train(state)

``run`` syncs the state from rank 0 and calls the function. When a rank dies, the
others' next collective fails with :class:`HorovodInternalError`; the launcher
(``horovodrun``/``ringrun --max-restarts K``) restarts the job and ``run`` resumes it
from the last commit that rank 0 persisted, calling the reset callbacks. Resizing in
place (continuing with fewer ranks without a restart) is not done: a restarted job
runs with the hosts the launcher has (see docs/migrate.md).
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


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Run ``func(state, ...)`` elastically (see the module doc)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        from ringtrain import runtime
        from ringtrain.horovod.basics import init, is_initialized

        if not is_initialized():
            init()
        resumed = state.resume_from_disk()
        state.sync()
        if resumed:
            log.warning("resumed from the last commit after a restart (attempt %d)",
                        runtime.world().env.attempt)
            state.on_reset()
        while True:
            try:
                result = func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                if not exc.skip_sync:
                    state.sync()
                state.on_reset()
                continue
            state.forget_persisted()  # finished: a later job must not resume from it
            return result

    return wrapper
