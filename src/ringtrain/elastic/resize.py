"""Resizing in place (``ringrun --min-np M --max-np N``): the worker's side of a resize.

The job is a series of worlds; ringrun writes each worker's next one to its assignment
file (:mod:`ringtrain.assignment`; the launcher's side is :mod:`ringtrain.launch.elastic`).
A watcher thread follows that file. When a collective fails because a peer is gone
(:func:`ringtrain.peer_failure.is_world_failure`) and ringrun has written the next
world, :func:`drive` restores the last commit, closes the old world's connections (a
host that vanished silently would leave them hanging), leaves the old world without
waiting for it, joins the new one, calls the reset callbacks and syncs the state from
rank 0 (the new workers of a grow get it that way). A grow is taken at a commit:
:func:`hosts_updated` (every rank, at the same point) tells whether ringrun has a newer
world, and the state raises :class:`~ringtrain.elastic.state.HostsUpdated`. Without
ringrun's ``--min-np``/``--max-np`` nothing of this is active and a failure propagates
as before.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ringtrain import assignment, collectives, runtime
from ringtrain.elastic.state import ElasticState, HostsUpdated
from ringtrain.errors import LaunchError, first_line
from ringtrain.peer_failure import is_world_failure

__all__ = ["POLL_S", "REFORM_WAIT_S", "RESEVER_S", "drive", "drop_steps", "follow_models", "follow_world",
           "hosts_updated", "resizable", "world_version"]

log = logging.getLogger("ringtrain.elastic")

T = TypeVar("T")

#: Seconds a failed collective waits for ringrun's next world before it is re-raised.
#: ringrun notices a host that vanished silently through ssh's keep-alive (about 15 s,
#: see launch/ssh.py) and a partitioned one through the agent's heartbeat (30 s).
REFORM_WAIT_S = 120.0


def reform_wait() -> float:
    """:data:`REFORM_WAIT_S`, or longer where ringrun waits longer for hosts
    (``--elastic-timeout``: it sets ``RINGTRAIN_REFORM_WAIT``)."""
    try:
        return max(REFORM_WAIT_S, float(os.environ.get("RINGTRAIN_REFORM_WAIT", "0")))
    except ValueError:
        return REFORM_WAIT_S


#: How often a worker looks at its assignment file.
POLL_S = 0.1

#: How often the connections to lost hosts are closed again until this process has
#: left for the next world (see :meth:`_AssignmentWatcher._again`).
RESEVER_S = 2.0


class _AssignmentWatcher:
    """Follows this worker's assignment file (ringrun's next world) on a daemon thread.

    A world that lost hosts is acted on at once: the old world's connections are closed,
    so an operation blocked on a host that vanished fails now instead of after its
    timeout, and those to the lost hosts again until this process moves on. A world that
    replaces one being joined makes that join fail the same way.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.current = -1  # the world this process is in (or joining)
        self.joining = False
        self._latest: dict[str, Any] | None = None
        self._resever_at = 0.0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ringtrain-elastic-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = -1
        while not self._stop.is_set():
            try:
                data = assignment.read_assignment(self.path)
                if data is not None and data["version"] > seen:
                    seen = data["version"]
                    # Acting and publishing under the lock that :meth:`begin_join` takes:
                    # a rank about to join an older world either sees this one published
                    # (and joins it instead) or is marked joining before this acts (and
                    # its join is cut). Between the two it could join a world nobody
                    # else joins, and wait there for its rendezvous timeout.
                    with self._cond:
                        try:
                            if seen > self.current:  # before anyone waiting for it moves on
                                self._act(data)
                                self._resever_at = time.monotonic() + RESEVER_S
                        finally:
                            # Published even if acting failed: the version is never read
                            # again, so a world dropped here would never be joined.
                            self._latest = data
                            self._cond.notify_all()
                with self._cond:
                    self._again()
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive a bad file
                log.debug("elastic watcher: %s", exc)
            self._stop.wait(POLL_S)

    def stop(self) -> None:
        """End the thread (a process keeps its watcher for life; tests make several)."""
        self._stop.set()
        self._thread.join(5.0)

    def _again(self) -> None:
        """Close the connections to the lost hosts again, every :data:`RESEVER_S`, until
        this process begins joining the next world. A connection opened to a lost host
        after the first close (Gloo retries a failed connect until its timeout; a group
        being built when the host vanished) would otherwise hold the process in the old
        world for minutes. Those hosts are in no later world: nothing else is closed."""
        latest = self._latest
        if latest is None or latest["version"] <= self.current or self.joining:
            return
        lost = [str(a) for a in latest.get("lost") or []]
        now = time.monotonic()
        if not lost or now < self._resever_at:
            return
        self._resever_at = now + RESEVER_S
        try:
            n = runtime.sever(lost)
        except (OSError, ValueError) as exc:
            log.debug("cannot close connections: %s", exc)
            return
        if n:
            log.debug("world %s: %d connection(s) to lost hosts %s closed again", latest["version"], n, lost)

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

    def begin_join(self, version: int) -> dict[str, Any] | None:
        """About to join world ``version``: a newer world if one is published already
        (join that one instead), else None, and this process is marked as joining
        ``version`` (a newer world read from now on cuts the join short)."""
        with self._cond:
            if self._latest is not None and self._latest["version"] > version:
                return self._latest
            self.current = version
            self.joining = True
            return None

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


_watcher: _AssignmentWatcher | None = None
_watcher_lock = threading.Lock()


def resizable() -> bool:
    """Whether this process belongs to a resizable job (``ringrun --min-np/--max-np``)."""
    return runtime.is_initialized() and bool(runtime.world().env.elastic_file)


def world_version() -> int:
    """Which of a resizable job's worlds this process is in (0: the first)."""
    return runtime.world().env.version if runtime.is_initialized() else 0


def _watch() -> _AssignmentWatcher:
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = _AssignmentWatcher(runtime.world().env.elastic_file)
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


def follow_world(optimizer: Any) -> bool:
    """Bring an optimizer to the current world after a resize (collective): its
    ``world_changed()`` hook, when it has one. ``DistributedOptimizer``: its averaging
    divides by the new size, an interrupted step is forgotten, and the first-step
    agreements (layout check, sparse parameters) run again on every rank, as they do on
    the ranks that just started. True when the hook brought the model to the new world
    itself (``rt.LocalSGD``/``rt.DiLoCo``: a joining rank takes the synced copy, the
    others keep their local steps): the caller must then not broadcast rank 0's
    parameters and optimizer state over them."""
    changed = getattr(optimizer, "world_changed", None)
    return callable(changed) and changed() is True


def follow_models(modules: Iterable[Any], followed: Iterable[Any] = ()) -> None:
    """Bring to the current world every live ``DistributedOptimizer`` that exchanges a
    parameter of ``modules`` and is not one of ``followed`` (those were brought by
    :func:`follow_world` already). An optimizer the state does not hold (a GAN's second
    one passed as a keyword, one left out of the state, the wrapped optimizer given to
    the state instead of the wrapper) kept averaging over the old size, silently: after
    3 ranks became 2 its gradients were 2/3 of Horovod's, which reads the size at every
    step. Not collective: ``DistributedOptimizer.world_changed`` only resets its own
    bookkeeping."""
    from ringtrain.optimizer import owner_of

    done = {id(o) for o in followed if o is not None}
    for module in modules:
        parameters = getattr(module, "parameters", None)
        if module is None or not callable(parameters):
            continue
        for p in parameters():
            opt = owner_of(p)
            if opt is not None and id(opt) not in done:
                done.add(id(opt))
                opt.world_changed()


def drop_steps(parts: Iterable[Any]) -> None:
    """Forget the step in progress of every ``DistributedOptimizer`` among ``parts`` or
    exchanging a parameter of a module among them, without waiting for its exchanges
    (not collective). Before a restore after a lost peer: the optimizer's
    ``load_state_dict`` waits for a step's launched exchanges, and in the broken world
    that wait raised the peer's failure again, so the survivor left the job instead of
    restoring (3 ranks, one killed mid-step: the job ended below ``--min-np``)."""
    from ringtrain.optimizer import DistributedOptimizer, owner_of

    done: set[int] = set()
    for part in parts:
        if isinstance(part, DistributedOptimizer):
            found: list[Any] = [part]
        elif callable(getattr(part, "parameters", None)):
            found = [owner_of(p) for p in part.parameters()]
        else:
            continue
        for opt in found:
            if opt is not None and id(opt) not in done:
                done.add(id(opt))
                opt.world_changed()  # a DistributedOptimizer's: its own bookkeeping only


class _Reformer:
    """Moves this process from the world it is in to ringrun's next one."""

    def __init__(self, leave: Callable[[Callable[[], object]], None], join: Callable[[], None]) -> None:
        self.leave = leave
        self.join = join

    def next_world(self, wait: float) -> bool:
        """Whether ringrun has (or, within ``wait`` seconds, writes) a newer world."""
        return resizable() and _watch().newer(world_version(), wait) is not None

    def reform(self) -> dict[str, Any]:
        """Join ringrun's newest world; its assignment (why it changed: ``reason``)."""
        watcher = _watch()
        target = watcher.newer(world_version(), 0.0)
        if target is None:
            raise LaunchError("no newer world from ringrun to move to")
        while True:
            if target.get("removed"):
                # The discovery script no longer lists this worker's slot: the others go
                # on without it from this commit; nothing of its state is lost.
                log.warning("ringrun removed this worker from the job (%s); it leaves at world %s",
                            target.get("reason", "its host is no longer listed"), target["version"])
                self.leave(lambda: None)
                raise SystemExit(0)
            # Everything of the old world goes: its connections (so nothing of it waits
            # on a peer; ``leave`` says when), then its groups.
            addresses = [str(a) for a in target.get("addresses") or []]
            self.leave(functools.partial(runtime.sever, addresses))
            runtime.assign({str(k): str(v) for k, v in target["env"].items()})
            newer = watcher.begin_join(int(target["version"]))
            if newer is not None:  # replaced before the watcher knew we were joining
                target = newer
                continue
            try:
                self.join()
                return target
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


def leave_world(sever: Callable[[], object]) -> None:
    """How ``rt.elastic`` leaves a world: close its connections, then abandon it."""
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
    sync = False
    while True:
        try:
            if sync:
                # Inside the try, as in Horovod: a peer lost while the new world takes
                # rank 0's state (a joining rank whose script failed after init) is one
                # more change of size, not the end of every survivor.
                sync = False
                state.sync()
            return call()
        except HostsUpdated as exc:
            # Rank 0 saw the new world; this rank's copy may be a moment behind.
            if not reformer.next_world(reform_wait()):
                raise
            skip_sync = exc.skip_sync
        except BaseException as exc:
            if not is_world_failure(exc) or not reformer.next_world(reform_wait()):
                raise
            log.debug("a peer failed (%s); moving to ringrun's next world", first_line(exc))
            drop = getattr(state, "drop_steps", None)  # a duck-typed state may lack it
            if callable(drop):
                drop()
            state.restore()
            skip_sync = False
        target = reformer.reform()
        if runtime.rank() == 0:
            # one line per change, from the new world's rank 0: what happened, the new
            # size, and that training goes on (ringrun prints its own side)
            log.warning("%s; world %s has %d rank(s); training goes on from the last commit",
                        target.get("reason") or "the job changed size", target["version"], runtime.size())
        state.on_reset()
        sync = not skip_sync
