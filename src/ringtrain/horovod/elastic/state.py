"""``hvd.elastic`` states: what a job commits, restores after a failure and syncs to
every rank.

``commit()`` keeps the state in memory, as Horovod's states do (copies of the models',
optimizers' and samplers' state dicts; the plain values themselves, see
:class:`ObjectState`), then asks whether the job's hosts changed
(:meth:`State.check_host_updates`). ``restore()`` returns to it; ``sync()`` gives every
rank rank 0's models, optimizers and samplers as they are now and rank 0's plain values
as last committed. In a resizable job (``--min-np/--max-np``) the commit in memory is
all a resize needs. In a fixed-size job that
recovers by restarting (``horovodrun``/``ringrun --max-restarts K``) rank 0 also writes
it to ``RINGTRAIN_ELASTIC_DIR`` (default ``.ringtrain-elastic/<run id>``) atomically, at
most every ``RINGTRAIN_ELASTIC_PERSIST_S`` seconds (default 1; 0: every commit), so
committing every batch stays cheap, and :func:`ringtrain.horovod.elastic.run` resumes
the restarted job from it.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ringtrain import checkpoint, elastic, runtime
from ringtrain.elastic.resize import drop_steps, follow_models
from ringtrain.elastic.state import ElasticState, copy_states, load_states
from ringtrain.errors import ConfigError
from ringtrain.horovod.elastic.sampler import ElasticSampler

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "persist_path"]

log = logging.getLogger("ringtrain.horovod.elastic")


class HostsUpdatedInterrupt(elastic.HostsUpdated):
    """The set of hosts changed; the job re-syncs its state (raised by ``commit()``)."""


def persist_path() -> Path | None:
    """Where rank 0 keeps the last commit (None: no launcher that restarts the job)."""
    if not runtime.is_initialized() or elastic.resizable():
        return None  # a resizable job keeps its commits in memory only
    env = runtime.world().env
    root = os.environ.get("RINGTRAIN_ELASTIC_DIR", "")
    if not root:
        if not env.run_id:
            return None
        root = os.path.join(".ringtrain-elastic", env.run_id)
    return Path(root) / "commit.ckpt"


def _persist_interval() -> float:
    raw = os.environ.get("RINGTRAIN_ELASTIC_PERSIST_S", "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < math.inf:
        # A typo here silently kept the 1 s default: the user's "persist every commit"
        # (0) did not happen, and a restart lost up to a second of commits.
        raise ConfigError(f"RINGTRAIN_ELASTIC_PERSIST_S={raw!r} is not a number of seconds >= 0; "
                          "set it to e.g. 0 (persist every commit) or 5, or unset it for 1 s")
    return value


class State(ElasticState):
    """Horovod's base state: commit (in memory, persisted by rank 0 in a fixed-size job),
    and the hooks subclasses fill in; reset callbacks, ``restore()`` and ``sync()`` are
    those of every elastic state (:class:`ringtrain.elastic.ElasticState`).

    A script's own state (Horovod's docs: "override the base ``hvd.elastic.State``")
    calls ``super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)`` and
    gives ``save()``, ``restore()`` and ``sync()``; it may use ``self._bcast_object`` and
    ``self._rank`` as Horovod's base keeps them. Without ``snapshot()`` and
    ``load_snapshot()`` its commits stay in memory: a fixed-size job restarted by ringrun
    starts it over (a warning says so after the restart)."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        super().__init__()
        if bcast_object is None:
            from ringtrain.horovod.functions import broadcast_object as bcast_object
        self._bcast_object = bcast_object
        self._rank = get_rank or runtime.rank
        _persist_interval()  # a bad value fails here, on every rank, not at rank 0's first commit
        self._last_persist = 0.0
        # A script's own subclass gives save/restore/sync only (all Horovod asks for).
        self._persistable = (type(self).snapshot is not State.snapshot
                             and type(self).load_snapshot is not State.load_snapshot)

    def commit(self) -> None:
        """Remember the current state (in memory; rank 0 persists it), then check hosts."""
        self.save()
        self._persist()
        self.check_host_updates()

    def reset(self) -> None:
        """Horovod's hook for subclasses: called on every rank after a reset event, before
        the reset callbacks and the sync."""

    def on_reset(self) -> None:
        self.reset()
        super().on_reset()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when ringrun has a larger (or
        other) world for the job (a resizable job; collective: rank 0's view decides, so
        all raise at the same commit). A fixed-size job has nothing to check."""
        if elastic.hosts_updated():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def _persist(self, force: bool = False) -> None:
        path = persist_path()
        if path is None or runtime.rank() != 0:
            return
        now = time.monotonic()
        if not force and now - self._last_persist < _persist_interval():
            return
        self._last_persist = now
        if not self._persistable:
            # Its commit cannot be written; the job goes on as under Horovod, which
            # persists nothing (before, every commit raised NotImplementedError on rank 0).
            return
        checkpoint.save(path, self.snapshot())

    def forget_persisted(self) -> None:
        path = persist_path()
        if path is not None and runtime.rank() == 0:
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass  # not empty or shared: leave the directory

    def resume_from_disk(self) -> bool:
        """After a restart: load the persisted commit (every rank calls it). True if one was found."""
        path = persist_path()
        if path is None:
            return False
        if not self._persistable:  # the same class, so the same answer, on every rank
            if runtime.world().env.attempt > 0 and runtime.rank() == 0:
                log.warning("restarted: %s has no snapshot()/load_snapshot(), so its commits were kept "
                            "in memory only and training starts over; give it both to resume from "
                            "the last commit", type(self).__name__)
            return False
        from ringtrain.collectives import broadcast_object

        found = broadcast_object(path.exists() if runtime.rank() == 0 else None, root_rank=0,
                                 name="elastic commit exists")
        if not found:
            return False
        self.load_snapshot(checkpoint.load(path))
        self.save()
        return True

    # -- filled in by subclasses --------------------------------------------------------

    def save(self) -> None:
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain values as attributes (``state.epoch``), Horovod's ``ObjectState``.

    As in Horovod, a commit keeps the values themselves, not copies: ``restore()`` sets
    each attribute back to the object it held at the last commit (a value rebound since,
    ``state.epoch = 3``, goes back; a list or dict changed in place stays as it is now),
    and ``sync()`` sets every rank's attributes to rank 0's last committed values, so
    what was assigned since is dropped, on rank 0 too. Before the first commit that is
    the state's keyword arguments: an attribute assigned between building the state and
    :func:`ringtrain.horovod.elastic.run` is reset to its keyword's value by the first
    sync."""

    def __init__(self, bcast_object: Callable[..., Any] | None = None,
                 get_rank: Callable[[], int] | None = None, **kwargs: Any) -> None:
        from ringtrain.horovod.functions import broadcast_object

        self._bcast = bcast_object or broadcast_object
        self._get_rank = get_rank or runtime.rank
        self._keys = list(kwargs)
        self._saved: dict[str, Any] = {}
        for k, v in kwargs.items():
            setattr(self, k, v)
        super().__init__(self._bcast, self._get_rank)
        self.save()

    def _values(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._keys if not self._handled(getattr(self, k))}

    def _handled(self, value: Any) -> bool:
        """Whether a keyword value is kept by its own state_dict rather than as a plain
        value (a copy of it, set back as a new object, would leave the script's object
        behind)."""
        return isinstance(value, ElasticSampler)

    def save(self) -> None:
        self._saved = self._values()

    def restore(self) -> None:
        self._set_saved()

    def sync(self) -> None:
        if self._saved:  # the same keys on every rank: all skip it or none
            self._saved = self._bcast(self._saved, 0)
            self._set_saved()

    def _set_saved(self) -> None:
        for k, v in self._saved.items():
            setattr(self, k, v)

    def snapshot(self) -> dict[str, Any]:
        return {"objects": copy.deepcopy(self._saved)}

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        for k, v in snap.get("objects", {}).items():
            setattr(self, k, v)


class TorchState(ObjectState):
    """A model, an optimizer, samplers and plain values (Horovod's ``TorchState``)."""

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        # Horovod's TorchState takes more models and optimizers as keywords (a GAN's
        # discriminator and its optimizer): each is saved, restored and synced through
        # its state_dict, in place, as `model` and `optimizer` are. As plain values they
        # were deep-copied, and sync()/restore() set a new object on the state while the
        # script trained its own, which stayed unsynced on every rank (replicas apart).
        self._torch_keys = [k for k, v in kwargs.items() if _is_torch_part(v)]
        self._saved_torch: dict[str, Any] = {}
        super().__init__(**kwargs)
        self._tracking = True

    def __setattr__(self, name: str, value: Any) -> None:
        """Horovod's: a model, optimizer or sampler the state keeps, replaced by another
        (``state.optimizer = new_optimizer``), is the one saved, restored and synced from
        now on, and its state now is its commit (``restore()`` must not load the old
        object's state into it)."""
        super().__setattr__(name, value)
        if not self.__dict__.get("_tracking"):
            return
        if name in self._samplers and isinstance(value, ElasticSampler):
            self._samplers[name] = value
            self._saved_torch["samplers"][name] = value.state_dict()
        elif name in ("model", "optimizer") or name in self._torch_keys:
            key = name if name in ("model", "optimizer") else f"kwargs.{name}"
            self._saved_torch.update(copy_states({key: value}))

    def _handled(self, value: Any) -> bool:
        return super()._handled(value) or _is_torch_part(value)

    def _parts(self) -> dict[str, Any]:
        """Every part kept through its state_dict (models, optimizers, schedulers), by
        the name its state is kept under."""
        extra = {f"kwargs.{k}": getattr(self, k) for k in self._torch_keys}
        return {"model": self.model, "optimizer": self.optimizer, **extra}

    def save(self) -> None:
        super().save()
        self._saved_torch = {**copy_states(self._parts()),
                             "samplers": {k: s.state_dict() for k, s in self._samplers.items()}}

    def drop_steps(self) -> None:
        drop_steps(self._parts().values())

    def restore(self) -> None:
        super().restore()
        # A copy: an optimizer's load_state_dict keeps the tensors it is given (Adam's
        # moments, its step) and the next steps change them in place, so a second
        # restore() before the next commit would go back to those steps, not the commit.
        self._apply(copy.deepcopy(self._saved_torch))

    def _apply(self, saved: dict[str, Any]) -> None:
        load_states(self._parts(), saved)
        for k, st in saved.get("samplers", {}).items():
            if k in self._samplers:
                self._samplers[k].load_state_dict(st)

    def sync(self) -> None:
        from ringtrain.horovod.functions import (
            allgather_object,
            broadcast_object,
            broadcast_optimizer_state,
            broadcast_parameters,
        )

        resized = elastic.resizable()
        # Averaging over the new size, a clean step; hvd.DiLoCo / hvd.LocalSGD bring the
        # model over themselves (a joining rank takes the synced copy, the others keep
        # their local steps), so rank 0's parameters must not overwrite theirs.
        own = resized and self.optimizer is not None and elastic.follow_world(self.optimizer)
        if resized:
            # Every other optimizer too: a keyword one (a GAN's), and any the state does
            # not hold that exchanges a model's gradients, averages over the new size.
            extra = [getattr(self, k) for k in self._torch_keys]
            for part in extra:
                if isinstance(part, torch.optim.Optimizer):
                    elastic.follow_world(part)
            follow_models([self.model, *extra], followed=[self.optimizer, *extra])
        if self.model is not None and not own:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None and not own:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for key in self._torch_keys:  # the same order on every rank: the keywords'
            part = getattr(self, key)
            if isinstance(part, torch.nn.Module):
                broadcast_parameters(part.state_dict(), root_rank=0)
            elif isinstance(part, torch.optim.Optimizer):
                broadcast_optimizer_state(part, root_rank=0)
            else:  # a learning-rate scheduler, a GradScaler: rank 0's state, loaded in place
                part.load_state_dict(broadcast_object(part.state_dict() if runtime.rank() == 0 else None,
                                                      0, name=f"elastic.state.{key}"))
        for key, sampler in self._samplers.items():
            # Horovod's: rank 0's record (its processed_num, which matches the model
            # synced from it: another survivor may have committed one batch more or less
            # when a peer died mid-step), split over the current ranks; and the union of
            # the indices each rank recorded itself (record_indices, Horovod < 0.23).
            got = broadcast_object(sampler.state_dict() if runtime.rank() == 0 else None, 0,
                                   name=f"elastic.sampler.{key}")
            seen = allgather_object(sorted(sampler.processed_indices), name=f"elastic.sampler.{key}.indices")
            got["processed_indices"] = sorted({i for part in seen for i in part})
            sampler.load_state_dict(got)
        super().sync()

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "torch": self._saved_torch}

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        super().load_snapshot(snap)
        self._apply(snap.get("torch", {}))


def _is_torch_part(value: Any) -> bool:
    """A keyword value TorchState keeps through its state_dict, in place: models and
    optimizers (Horovod's handlers), and learning-rate schedulers and GradScalers, which
    as plain values were deep-copied with the optimizer they point to, so after a
    restore() ``state.scheduler.step()`` changed the copy's learning rate, not the real
    optimizer's."""
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer,
                              torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler))
