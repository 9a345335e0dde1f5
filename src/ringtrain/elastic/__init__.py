"""``rt.elastic``: training that survives lost workers, by restart or in place.

**Restart and resume** (``ringrun --max-restarts K``, :mod:`.resume`): ringrun restarts
the whole job when a worker dies, and :class:`Resumable` makes the script pick up where
the last checkpoint left off, so at most ``every`` steps are redone and the result is the
same as an uninterrupted run (bit for bit on CPU with fixed seeds)::

    state = rt.elastic.Resumable("runs/ckpt", model=model, optimizer=opt,
                                 loader=loader, every=100)
    for step in range(state.resume(), total_steps):      # 0 on a fresh start
        ...one training step...
        state.step_done(step + 1)                         # saves every 100 steps

**Resizing in place** (``ringrun --min-np M --max-np N``, :mod:`.resize`): a job whose
workers or hosts are lost goes on with the others, and grows onto hosts a discovery
script reports, without a restart and from the last commit in memory::

    state = rt.elastic.Resumable("runs/ckpt", model=model, optimizer=opt, loader=loader)
    state.register_reset_callbacks([lambda: set_lr(base_lr * rt.size())])

    @rt.elastic.run
    def train(state):
        for step in range(state.step, total_steps):
            ...one training step...
            state.step_done(step + 1)    # commits in memory; saves every `every` steps

    train(state)

:func:`run` (:mod:`.runner`) resumes, then drives the resize loop (:func:`drive`, the
engine under ``hvd.elastic.run`` too). Both kinds of state, :class:`Resumable` and
Horovod's ``hvd.elastic`` states, are :class:`ElasticState` s (:mod:`.state`). The
launcher's side of a resize is :mod:`ringtrain.launch.elastic`; the two talk through
the files of :mod:`ringtrain.assignment`.
"""

from __future__ import annotations

from ringtrain.elastic.resize import drive, follow_world, hosts_updated, resizable, world_version
from ringtrain.elastic.resume import Resumable, attempt
from ringtrain.elastic.runner import run
from ringtrain.elastic.state import ElasticState, HostsUpdated, Stateful

__all__ = ["ElasticState", "HostsUpdated", "Resumable", "Stateful", "attempt", "drive",
           "follow_world", "hosts_updated", "resizable", "run", "world_version"]
