"""Training that survives a dead worker: periodic checkpoints and an exact resume.

``ringrun --max-restarts K`` restarts the whole job when a worker dies; this module
makes the script pick up where the last checkpoint left off, so at most ``every``
steps are redone and the result is the same as an uninterrupted run (bit for bit on
CPU with fixed seeds: model, optimizer, the loader's position and every rank's random
number generators are restored)::

    state = rt.elastic.Resumable("runs/ckpt", model=model, optimizer=opt,
                                 loader=loader, every=100)
    for step in range(state.resume(), total_steps):      # 0 on a fresh start
        ...one training step...
        state.step_done(step + 1)                         # saves every 100 steps

A restart gives every attempt a fresh process group and rendezvous (FIELD-NOTES:
reusing a dead attempt's addresses hung torchrun restarts), and costs one interpreter
start plus the work since the last checkpoint.

**Resizing in place** (``ringrun --min-np M --max-np N``, :mod:`ringtrain.launch.elastic`):
a job whose workers or hosts are lost goes on with the others, and grows onto hosts a
discovery script reports, without a restart and from the last commit in memory::

    state = rt.elastic.Resumable("runs/ckpt", model=model, optimizer=opt, loader=loader)
    state.register_reset_callbacks([lambda: set_lr(base_lr * rt.size())])

    @rt.elastic.run
    def train(state):
        for step in range(state.step, total_steps):
            ...one training step...
            state.step_done(step + 1)    # commits in memory; saves every `every` steps

    train(state)

:func:`run` is the engine under ``hvd.elastic.run`` too. When a collective fails
because a peer is gone and ringrun has written the next world
(:mod:`ringtrain.assignment`), it restores the last commit, closes the old
world's connections (a host that vanished silently would leave them hanging), leaves
the old world without waiting for it, joins the new one, calls the reset callbacks and
syncs the state from rank 0 (the new workers of a grow get it that way). A grow is
taken at a commit: :func:`hosts_updated` (every rank, at the same point) tells whether
ringrun has a newer world, and the state raises :class:`HostsUpdated`. Without ringrun's
``--min-np``/``--max-np`` nothing of this is active and a failure propagates as before.

Every rank must call :meth:`Resumable.resume`, :meth:`Resumable.step_done` and
:meth:`Resumable.save` at the same steps (they exchange the per-rank states).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from ringtrain import assignment, checkpoint, collectives, replicate, runtime
from ringtrain.errors import ConfigError, LaunchError, first_line
from ringtrain.peer_failure import is_world_failure

__all__ = ["ElasticState", "HostsUpdated", "Resumable", "Stateful", "attempt", "drive",
           "follow_world", "hosts_updated", "resizable", "run", "world_version"]

log = logging.getLogger("ringtrain.elastic")

T = TypeVar("T")

#: Seconds a failed collective waits for ringrun's next world before it is re-raised.
#: ringrun notices a host that vanished silently through ssh's keep-alive (about 15 s,
#: see launch/ssh.py) and a partitioned one through the agent's heartbeat (30 s).
REFORM_WAIT_S = 120.0
#: How often a worker looks at its assignment file.
POLL_S = 0.1

_NAME = "step-{:09d}" + checkpoint.SUFFIX
_STEP = re.compile(r"step-(\d+)" + re.escape(checkpoint.SUFFIX) + "$")


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (a model, optimizer, loader)."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


def attempt() -> int:
    """How many times ringrun (or torchrun) has restarted this job; 0 on the first start."""
    return runtime.world().env.attempt if runtime.is_initialized() else 0


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Resumable:
    """Saves the training state every ``every`` steps and restores the newest on start.

    ``extra`` is a dict of plain values (epoch, best score...) saved and restored with
    the rest; read it after :meth:`resume`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: Stateful,
        optimizer: Stateful | None = None,
        loader: Stateful | None = None,
        every: int = 100,
        keep: int = 2,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if every < 1:
            raise ConfigError(f"every must be >= 1 step, got {every}")
        if keep < 1:
            raise ConfigError(f"keep must be >= 1 checkpoint, got {keep}")
        self.directory = Path(directory)
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.every = every
        self.keep = keep
        self.extra: dict[str, Any] = dict(extra or {})
        #: The step the last :meth:`resume` started from (0 on a fresh start).
        self.start_step = 0
        #: The checkpoint :meth:`resume` loaded, if any.
        self.resumed_from: Path | None = None
        #: The step to go on from: the last resume or commit (what :func:`run` restarts at).
        self.step = 0
        self._commit: dict[str, Any] | None = None
        self._reset_callbacks: list[Callable[[], None]] = []

    def _size_rank(self) -> tuple[int, int]:
        if runtime.is_initialized():
            return runtime.size(), runtime.rank()
        return 1, 0

    def resume(self) -> int:
        """Load the newest complete checkpoint (every rank gets it); the step to go on from.

        Without a checkpoint, rank 0's model parameters are broadcast so every rank starts
        from the same weights, and 0 is returned.
        """
        size, rank = self._size_rank()
        path = checkpoint.latest(self.directory, pattern="step-*" + checkpoint.SUFFIX)
        if size > 1:
            # Rank 0 decides: the directory may not be shared, or may change under us.
            path = collectives.broadcast_object(str(path) if path else None, root_rank=0,
                                                name="elastic.resume")
            path = Path(path) if path else None
        if path is None:
            if size > 1:
                for name, tensor in self.model.state_dict().items():
                    collectives.broadcast_(tensor, root_rank=0, name=f"elastic.init {name}")
            self.start_step = self.step = 0
            return 0
        state = checkpoint.load(path)  # safe: only what Resumable itself saves
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        per_rank = state.get("per_rank") or []
        mine = per_rank[rank] if len(per_rank) == size else None
        if mine is None and per_rank:
            log.warning("checkpoint %s was written by %d ranks, this job has %d: loader positions "
                        "come from rank 0 and random generators are not restored",
                        path, len(per_rank), size)
        if self.loader is not None:
            loader_state = (mine or per_rank[0])["loader"] if per_rank else None
            if loader_state is not None:
                self.loader.load_state_dict(loader_state)
        if mine is not None:
            _set_rng_state(mine["rng"])
        self.extra.update(state.get("extra", {}))
        self.start_step = self.step = int(state["step"])
        self.resumed_from = path
        log.info("resumed from %s at step %d", path, self.start_step)
        return self.start_step

    def step_done(self, step: int) -> bool:
        """Call after each step with the number of steps completed; saves on multiples of
        ``every`` (and, in a resizable job, commits in memory every step)."""
        if resizable():
            self.commit(step)
        if step % self.every:
            return False
        self.save(step)
        return True

    # -- resizing in place (see the module doc) ---------------------------------------------

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Called on every rank after the job changed size (e.g. to scale the rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for cb in self._reset_callbacks:
            cb()

    def commit(self, step: int) -> None:
        """Remember the state after ``step`` steps in memory (no collective, no disk);
        :meth:`restore` goes back to it."""
        self.step = step
        self._commit = copy.deepcopy({
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "loader": self.loader.state_dict() if self.loader is not None else None,
            "extra": self.extra,
        })

    def restore(self) -> None:
        """Go back to the last :meth:`commit` (after a peer failed mid-step)."""
        if self._commit is None:
            return
        snap = copy.deepcopy(self._commit)
        self.model.load_state_dict(snap["model"])
        if self.optimizer is not None and snap["optimizer"] is not None:
            self.optimizer.load_state_dict(snap["optimizer"])
        if self.loader is not None and snap["loader"] is not None:
            self.loader.load_state_dict(snap["loader"])
        self.extra = snap["extra"]
        self.step = int(snap["step"])

    def sync(self) -> None:
        """Every rank takes rank 0's state (collective; after the job changed size)."""
        if self.optimizer is not None:
            follow_world(self.optimizer)
        if runtime.size() > 1:
            replicate.broadcast_parameters(self.model.state_dict(), root_rank=0)
            if isinstance(self.optimizer, torch.optim.Optimizer):
                replicate.broadcast_optimizer_state(self.optimizer, root_rank=0)
            mine = {"step": self.step, "extra": self.extra,
                    "loader": self.loader.state_dict() if self.loader is not None else None}
            got = collectives.broadcast_object(mine if runtime.rank() == 0 else None, root_rank=0,
                                               name="elastic.sync")
            self.step, self.extra = int(got["step"]), dict(got["extra"])
            if self.loader is not None and got["loader"] is not None:
                # The rest of the epoch is split over the new world (the loader's state is
                # a global position, see ringtrain.data.order).
                self.loader.load_state_dict(got["loader"])
        self.commit(self.step)

    def save(self, step: int) -> Path | None:
        """Save now (every rank must call it); rank 0 writes ``step-<step>.ckpt``."""
        size, rank = self._size_rank()
        mine = {
            "rng": _rng_state(),
            "loader": self.loader.state_dict() if self.loader is not None else None,
        }
        per_rank = collectives.allgather_object(mine, name="elastic.save") if size > 1 else [mine]
        if rank != 0:
            return None
        state = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "per_rank": per_rank,
            "extra": dict(self.extra),
        }
        path = checkpoint.save(self.directory / _NAME.format(step), state)
        self._prune()
        return path

    def _prune(self) -> None:
        found = sorted(
            (int(m.group(1)), p) for p in self.directory.glob("step-*" + checkpoint.SUFFIX)
            if (m := _STEP.search(p.name))
        )
        for _, old in found[: -self.keep]:
            old.unlink(missing_ok=True)


# -- resizing in place (ringrun --min-np/--max-np) ----------------------------------------


class HostsUpdated(RuntimeError):
    """ringrun has a newer world for the job; raised at a commit so every rank moves to
    it at the same point (``hvd.elastic.HostsUpdatedInterrupt`` is one)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


class ElasticState(Protocol):
    """What :func:`drive` needs of a state: go back to the last commit, take rank 0's,
    tell the script the world changed."""

    def restore(self) -> None: ...
    def sync(self) -> None: ...
    def on_reset(self) -> None: ...


class _Watcher:
    """Follows this worker's assignment file (ringrun's next world) on a daemon thread.

    A world that lost hosts is acted on at once: the connections to the lost hosts are
    closed, so an operation blocked on one that vanished fails now instead of after its
    timeout. A world that replaces one being joined makes that join fail the same way.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.current = -1  # the world this process is in (or joining)
        self.joining = False
        self._latest: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ringtrain-elastic-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = -1
        while True:
            try:
                data = assignment.read_assignment(self.path)
                if data is not None and data["version"] > seen:
                    seen = data["version"]
                    if seen > self.current:  # before anyone waiting for it moves on
                        self._act(data)
                    with self._cond:
                        self._latest = data
                        self._cond.notify_all()
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive a bad file
                log.debug("elastic watcher: %s", exc)
            time.sleep(POLL_S)

    def _act(self, data: dict[str, Any]) -> None:
        lost = [str(a) for a in data.get("lost") or []]
        addresses = [str(a) for a in data.get("addresses") or []]
        try:
            if self.joining:
                n = runtime.sever(addresses)
                log.debug("world %s replaces the one being joined: %d connection(s) closed", data["version"], n)
            elif lost:
                # The old world is over for every survivor, not only for the ranks that
                # talked to the lost host: one may wait on another survivor that has
                # already left (a broadcast from it, a store key it would have set) and
                # would only be freed by the stall timeout. Close all of the old world.
                n = runtime.sever(sorted(set(lost) | set(addresses)))
                log.debug("world %s: hosts %s lost, %d connection(s) closed", data["version"], lost, n)
        except (OSError, ValueError) as exc:  # /proc unreadable: operations time out instead
            log.debug("cannot close connections: %s", exc)

    def latest(self) -> dict[str, Any] | None:
        with self._cond:
            return self._latest

    def newer(self, than: int, timeout: float) -> dict[str, Any] | None:
        """ringrun's newest world if it is after ``than``, waiting up to ``timeout``."""
        with self._cond:
            self._cond.wait_for(lambda: self._latest is not None and self._latest["version"] > than,
                                timeout)
            latest = self._latest
        return latest if latest is not None and latest["version"] > than else None


_watcher: _Watcher | None = None
_watcher_lock = threading.Lock()


def resizable() -> bool:
    """Whether this process belongs to a resizable job (``ringrun --min-np/--max-np``)."""
    return runtime.is_initialized() and bool(runtime.world().env.elastic_file)


def world_version() -> int:
    """Which of a resizable job's worlds this process is in (0: the first)."""
    return runtime.world().env.version if runtime.is_initialized() else 0


def _watch() -> _Watcher:
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = _Watcher(runtime.world().env.elastic_file)
        _watcher.current = max(_watcher.current, world_version())
        return _watcher


def hosts_updated() -> bool:
    """Whether ringrun has a newer world than this one. Collective: every rank calls it
    at the same point (a commit); rank 0's answer is everyone's, so all move together."""
    if not resizable():
        return False
    mine = _watch().latest() if runtime.rank() == 0 else None
    newest = collectives.broadcast_object(mine["version"] if mine else -1, root_rank=0,
                                          name="elastic.hosts_updated")
    return int(newest) > world_version()


def follow_world(optimizer: Any) -> None:
    """Bring a ``DistributedOptimizer`` to the current world after a resize: its averaging
    divides by the new size, an interrupted step is forgotten, and the first-step
    agreements (layout check, sparse parameters) run again on every rank, as they do on
    the ranks that just started."""
    changed = getattr(optimizer, "world_changed", None)
    if callable(changed):
        changed()  # ringtrain's DistributedOptimizer; any other caches nothing of the world


class _Reformer:
    """Moves this process from the world it is in to ringrun's next one."""

    def __init__(self, leave: Callable[[Callable[[], object]], None], join: Callable[[], None]) -> None:
        self.leave = leave
        self.join = join

    def next_world(self, wait: float) -> bool:
        """Whether ringrun has (or, within ``wait`` seconds, writes) a newer world."""
        return resizable() and _watch().newer(world_version(), wait) is not None

    def reform(self) -> None:
        watcher = _watch()
        target = watcher.newer(world_version(), 0.0)
        if target is None:
            raise LaunchError("no newer world from ringrun to move to")
        while True:
            # Everything of the old world goes: its connections (so nothing of it waits
            # on a peer; ``leave`` says when), then its groups.
            addresses = [str(a) for a in target.get("addresses") or []]
            self.leave(functools.partial(runtime.sever, addresses))
            runtime.assign({str(k): str(v) for k, v in target["env"].items()})
            watcher.current = int(target["version"])
            watcher.joining = True
            try:
                newer = watcher.newer(int(target["version"]), 0.0)
                if newer is not None:  # replaced before the watcher knew we were joining
                    target = newer
                    continue
                self.join()
                return
            except Exception as exc:  # noqa: BLE001 - a newer world may have replaced this one
                newer = watcher.newer(int(target["version"]), 0.0)
                if newer is None:  # the reason may be on its way (a peer just died)
                    newer = watcher.newer(int(target["version"]), 2.0)
                if newer is None:
                    raise
                log.warning("world %s did not form (%s); joining world %s",
                            target["version"], first_line(exc, None),
                            newer["version"])
                target = newer
            finally:
                watcher.joining = False


def _leave_world(sever: Callable[[], object]) -> None:
    sever()
    runtime.abandon()


def drive(call: Callable[[], T], state: ElasticState, leave: Callable[[Callable[[], object]], None],
          join: Callable[[], None], start: Callable[[], None]) -> T:
    """The elastic loop under :func:`run` and ``hvd.elastic.run``: ``start()`` once,
    then ``call()`` until it returns; a lost peer (with a newer world from ringrun) or a
    :class:`HostsUpdated` moves the process to the next world, where the reset callbacks
    run and the state is synced from rank 0 (Horovod's order). ``leave(sever)`` leaves
    the old world, calling ``sever()`` (close its connections) before it waits on any
    of its threads; ``join()`` joins the next one (the runtime is assigned it)."""
    reformer = _Reformer(leave, join)
    if resizable():
        _watch()
    start()
    while True:
        try:
            return call()
        except HostsUpdated as exc:
            # Rank 0 saw the new world; this rank's copy may be a moment behind.
            if not reformer.next_world(REFORM_WAIT_S):
                raise
            skip_sync = exc.skip_sync
        except BaseException as exc:
            if not is_world_failure(exc) or not reformer.next_world(REFORM_WAIT_S):
                raise
            log.warning("a peer failed (%s); moving to ringrun's next world",
                        first_line(exc))
            state.restore()
            skip_sync = False
        reformer.reform()
        state.on_reset()
        if not skip_sync:
            state.sync()


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Run ``func(state, ...)`` with a :class:`Resumable` ``state`` elastically: resumed
    from its checkpoint at the start, moved to ringrun's next world in place when the job
    resizes (see the module doc). In a fixed-size job it just resumes and calls ``func``."""

    @functools.wraps(func)
    def wrapper(state: Resumable, *args: Any, **kwargs: Any) -> T:
        # rt.init, the public entry (the composition root sits above this layer).
        import ringtrain as rt

        def join() -> None:
            rt.init()

        def start() -> None:
            if not runtime.is_initialized():
                rt.init()
            if world_version() == 0:
                state.resume()
            else:
                state.sync()  # a worker that joins a running job: rank 0's state
            state.commit(state.step)

        return drive(lambda: func(state, *args, **kwargs), state, _leave_world, join, start)

    return wrapper
