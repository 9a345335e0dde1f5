"""The coordinator: Horovod's execution model on ``torch.distributed``.

``torch.distributed`` runs collectives in the order each rank issues them, so ranks
that issue them in different orders hang or exchange unrelated tensors. Horovod's
model is different, and scripts written for it rely on it: an operation is *named*,
ranks may submit named operations in any order and from any thread, an operation runs
once every member of its process set has submitted it, ranks that ran out of data
``join()`` and contribute zeros, and a mismatch is an error on every rank.

One background thread per process does it in *cycles*:

1. Wait, without spinning, until some rank wants a cycle: a submission sets the store
   key ``c/<k>`` for the next cycle; every thread blocks in ``store.wait`` on it.
2. Exchange what each rank submitted since the last cycle (name, kind, dtype, shape, op,
   process set, ...; no tensor data) and its join/stop flags, with one
   ``all_gather_object`` on a private Gloo group.
3. From the same gathered table every rank computes the same decisions: which
   operations are complete (every member submitted, or joined where that is allowed),
   which mismatch (:func:`~.requests.mismatch`), and the order to run them in (order
   of first submission). Ready allreduces of one dtype and set are fused into one flat
   buffer up to the fusion threshold.
4. Run them (:mod:`~.execute`) on the process sets' private groups, complete the
   handles.

A handle's wait logs a warning naming the ranks that have not submitted the operation
every ``stall_warning`` seconds, as Horovod's stall check does, and gives up after
``stall_timeout`` with a :class:`StallError` naming them (``None``: it waits as long
as it takes, Horovod's default).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import inflight, runtime
from ringtrain.errors import CollectiveError, ConfigError, MismatchError, StallError, first_line
from ringtrain.horovod._coordinator import execute
from ringtrain.horovod._coordinator.execute import Group, Request
from ringtrain.horovod._coordinator.process_sets import ProcessSet
from ringtrain.horovod._coordinator.requests import REDUCING, Meta, fusable, mismatch
from ringtrain.horovod._coordinator.trace import Trace
from ringtrain.peer_failure import Failure, classify

__all__ = ["Engine", "NegotiationError", "PendingOp"]

log = logging.getLogger("ringtrain.coordinator")

_JOIN = "__join__"


class NegotiationError(CollectiveError):
    """Every member submitted the operation, and it cannot run as asked: a broadcast root
    outside the set, an allgather after join(), a set not registered on every rank. A
    bug in the script, so not recoverable: as a recoverable error it became
    ``HorovodInternalError``, and a resizable job waited for a new world that no lost
    rank would bring, where the script's mistake should end the job at once."""

    recoverable = False


def _gather_places(size: int, group: Any) -> list[tuple[int, int]]:
    """Every rank's (local rank, local size) in this world (its launch environment's)."""
    if size == 1:
        return [(0, 1)]
    env = runtime.world().env
    mine = torch.tensor([env.local_rank, env.local_size], dtype=torch.int64)
    parts = [torch.empty(2, dtype=torch.int64) for _ in range(size)]
    inflight.hold(mine, *parts)
    dist.all_gather(parts, mine, group=group)
    return [(int(p[0]), int(p[1])) for p in parts]


class PendingOp:
    """One submitted operation; :meth:`wait` returns its result or raises its error."""

    def __init__(self, engine: Engine, meta: Meta, request: Request | None) -> None:
        self.engine = engine
        self.meta = meta
        self.request = request
        self.submitted_at = time.perf_counter()
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        #: CUDA: the end of the operation on the cycle thread's stream (see _record).
        self._done: tuple[torch.device, Any] | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def _finish(self, result: Any = None, error: BaseException | None = None,
                done: tuple[torch.device, Any] | None = None) -> None:
        self._result, self._error, self._done = result, error, done
        self._event.set()

    def wait(self) -> Any:
        timeout, every = self.engine.stall_timeout, self.engine.stall_warning
        start = time.monotonic()
        warn_at = every
        while True:
            marks = [m for m in (warn_at, timeout) if m is not None]
            left = None if not marks else max(0.0, min(marks) - (time.monotonic() - start))
            if self._event.wait(left):
                break
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                raise self.engine.stall_error(self.meta, timeout)
            if warn_at is not None and every is not None and waited >= warn_at:
                log.warning("%s", self.engine.stall_text(self.meta, waited, final=False))
                warn_at += every
        if self._error is not None:
            raise self._error
        if self._done is not None:
            # The result is written on the cycle thread's stream: the waiter's stream
            # (the one the script reads it on) waits for that, as NCCL's work.wait() does.
            device, event = self._done
            torch.cuda.current_stream(device).wait_event(event)
        return self._result


@dataclass
class _Entry:
    """What the job knows of one name: the metas of the ranks that submitted it."""

    order: int
    metas: dict[int, Meta] = field(default_factory=dict)


class Engine:
    """The coordinator of one process (see the module docstring)."""

    def __init__(self, rank: int, size: int, connect: Callable[[], dist.Store] | None, *,
                 fusion_bytes: int, stall_timeout: float | None, cuda_backend: str | None = None,
                 stall_warning: float | None = None, device: torch.device | None = None) -> None:
        """``connect()`` opens a new connection to the job's store (None: a 1-process
        world, woken in-process). The cycle thread and the submitting threads each get
        their own: a store client serialises its calls, and the thread's blocking
        ``wait`` would hold up every submission.

        ``device``: this process's GPU (``cuda:<local_rank>``), made the cycle thread's
        current device. CUDA's current device is per thread: a new thread starts on
        ``cuda:0``, so a joined rank's zeros (``torch.cuda.current_device()``) went to
        GPU 0 on every local rank and NCCL got a second rank on that GPU."""
        self.rank, self.size = rank, size
        self._waker: _Waker = _StoreWaker(connect) if connect is not None and size > 1 else _LocalWaker()
        self.fusion_bytes = fusion_bytes
        self.stall_timeout = stall_timeout
        self.stall_warning = stall_warning
        self._cuda_backend = cuda_backend
        self._device = device if device is not None and device.type == "cuda" else None
        # Private groups: the cycle exchange and the operations never interleave with
        # the collectives the script issues on the default group meanwhile.
        control = dist.new_group(backend="gloo")
        cuda = dist.new_group(backend=cuda_backend) if cuda_backend else None
        self.control = control
        #: Every rank's (local rank, local size), by rank, gathered once here (before the
        #: cycle thread uses the control group): Horovod's cross communicator and
        #: is_homogeneous come from them, as its controllers gather them at init.
        self.places = _gather_places(size, control)
        self.sets: dict[int, tuple[ProcessSet, Group]] = {}
        self.global_set = ProcessSet(range(size))
        self.global_set._bind(0, list(range(size)), rank, None)
        self.sets[0] = (self.global_set, Group(list(range(size)), control, cuda))
        self._next_set_id = 1
        self.trace = Trace(rank)
        self._lock = threading.Lock()
        self._outbox: list[Meta] = []
        # Names are per process set, as in Horovod: (set id, name) identifies an operation.
        self._pending: dict[tuple[int, str], PendingOp] = {}  # this rank's, not finished yet
        self._table: dict[tuple[int, str], _Entry] = {}  # the job's, not run yet
        self._running: set[tuple[int, str]] = set()  # decided by every member, in the backend now
        self._order = itertools.count()
        self._cycle = 0  # the cycle the next submission goes into
        self._signalled = -1
        self._joined_local = False
        self._join_handle: PendingOp | None = None
        self._joined: set[int] = set()
        self._last_joined = -1
        self._stopping_local = False
        self._aborted = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ringtrain-coordinator", daemon=True)
        self._thread.start()

    # -- process sets (collective: every rank calls them in the same order) -----------------

    def add_process_set(self, ps: ProcessSet) -> ProcessSet:
        if ps.ranks is None:
            raise ConfigError("a process set needs its ranks, e.g. hvd.ProcessSet([0, 1])")
        # Horovod's convention: no ranks means every rank (its global set is
        # ProcessSet([])), so a script's odd-ranks set at size 1 is not an error; like
        # Horovod's, such a set is never a duplicate of another.
        every = not ps.ranks
        ranks = list(ps.ranks) or list(range(self.size))
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise ConfigError(f"process set ranks {ranks} must be within 0..{self.size - 1}")
        for other, _ in self.sets.values():
            if not every and other.ranks == ranks and other.process_set_id != 0:
                raise ConfigError(f"a process set with ranks {ranks} is already registered "
                                  f"(id {other.process_set_id})")
        cpu = dist.new_group(ranks, backend="gloo")
        cuda = dist.new_group(ranks, backend=self._cuda_backend) if self._cuda_backend else None
        set_id = self._next_set_id  # (only the script's thread registers sets)
        ps._bind(set_id, ranks, self.rank, cpu)
        with self._lock:
            # Together, under the lock: the cycle thread tells a set registered on a
            # faster rank only (id >= _next_set_id) from a removed one by this counter.
            self.sets[set_id] = (ps, Group(ranks, cpu, cuda))
            self._next_set_id = set_id + 1
        return ps

    def remove_process_set(self, ps: ProcessSet) -> bool:
        set_id = ps.process_set_id
        if set_id <= 0 or set_id not in self.sets:
            return False
        with self._lock:
            _, group = self.sets.pop(set_id)
        for pg in (group.cpu, group.cuda):
            if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(pg)
        ps._unbind()
        return True

    def group_of(self, set_id: int) -> Group:
        if set_id not in self.sets:
            raise ConfigError(f"process set {set_id} is not registered (removed, or never added)")
        return self.sets[set_id][1]

    # -- submitting ---------------------------------------------------------------------

    def submit(self, meta: Meta, request: Request | None) -> PendingOp:
        return self.submit_many([meta], [request])[0]

    def submit_many(self, metas: Sequence[Meta], requests: Sequence[Request | None]) -> list[PendingOp]:
        """Submit operations together: all go into one cycle, or none is submitted. The
        members of a grouped call reach the other ranks at once (as Horovod enqueues a
        group), so a refusal of the group fails every member in one decision (:meth:`_decide`)."""
        for meta in metas:
            if meta.refused and meta.set_id not in self.sets and 0 < meta.set_id < self._next_set_id:
                continue  # a set removed on this rank only: the members that still have it hear why
            ps_group = self.group_of(meta.set_id)
            if self.rank not in ps_group.ranks:
                raise ConfigError(f"rank {self.rank} is not in process set {meta.set_id} "
                                  f"(ranks {ps_group.ranks}); only its members may use it")
        handles = [PendingOp(self, m, r) for m, r in zip(metas, requests, strict=True)]
        for r in requests:
            dev = _cuda_device(r)
            if r is not None and dev is not None:
                # The tensor was written on the submitting thread's stream: the cycle
                # thread's stream waits for this point before reading it (Horovod's ready
                # event). Without it a tensor made on a side stream went out unfinished.
                r.ready = _record(dev)
        with self._lock:
            self._raise_if_failed()
            for meta in metas:
                if self._joined_local:
                    raise ConfigError(f"{meta.kind} {meta.name!r} after join() on this rank: a rank "
                                      "that joined takes no further part until every rank has joined")
                if meta.key in self._pending:
                    raise ValueError(
                        f"a {self._pending[meta.key].meta.kind} named {meta.name!r} is still in "
                        "progress on this rank: names of concurrent operations must be unique"
                    )
            for h in handles:
                self._pending[h.meta.key] = h
                self._outbox.append(h.meta)
            self._signal()
        for meta in metas:
            self.trace.submitted(meta)
        return handles

    def join(self) -> PendingOp:
        meta = Meta(_JOIN, "barrier")
        handle = PendingOp(self, meta, None)
        with self._lock:
            self._raise_if_failed()
            if self._joined_local:
                raise ConfigError("join() called twice before every rank joined")
            self._joined_local = True
            self._join_handle = handle
            self._signal()
        return handle

    def _signal(self) -> None:
        # Called under the lock: ask for the cycle this submission goes into, once.
        if self._signalled != self._cycle:
            self._waker.signal(self._cycle)
            self._signalled = self._cycle

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise CollectiveError(f"the coordinator stopped: {self._failed}")

    # -- stopping -----------------------------------------------------------------------

    def shutdown(self, timeout: float = 30.0) -> None:
        """Leave the cycles once every rank has asked to (collective)."""
        if self._aborted:  # the others are not asked: the world is gone (see abort)
            self.sets.clear()
            return
        with self._lock:
            self._stopping_local = True
            try:
                self._signal()
            except Exception as exc:  # noqa: BLE001 - the store may be gone already
                log.debug("coordinator shutdown: cannot signal (%s)", exc)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the coordinator thread did not stop within %.0f s (a rank never "
                        "shut down); leaving it behind", timeout)
            # The thread sits in the backend; if it woke while the interpreter finalizes
            # it would abort the process (SIGABRT). Marked broken, the process skips the
            # teardown and leaves with status 1 at exit (runtime's exit guard).
            runtime.mark_broken("the coordinator did not stop: a rank never shut down")
            return
        for ps, _group in list(self.sets.values()):
            if ps.process_set_id != 0:
                ps._unbind()
        self.sets.clear()

    def abort(self, reason: str, sever: Callable[[], object] = lambda: None, timeout: float = 5.0) -> None:
        """Stop without the other ranks (a resizable job leaving a world that changed):
        pending operations fail and no cycle runs any more. The cycle thread is woken
        through the store first (it then leaves quietly); ``sever()`` then closes the
        world's connections (``runtime.sever``), which ends whatever of it still waits on
        a peer, and the thread is waited for up to ``timeout``."""
        with self._lock:
            self._aborted = True
            cycle = self._cycle
        self._fail_all(CollectiveError(reason))
        try:
            self._waker.signal(cycle)
        except Exception as exc:  # noqa: BLE001 - the store's host may be gone
            log.debug("coordinator abort: cannot wake the cycle thread (%s)", exc)
        sever()
        self._thread.join(timeout)

    def stall_error(self, meta: Meta, timeout: float) -> StallError:
        runtime.mark_broken(f"{meta.kind} {meta.name!r} stalled")
        return StallError(self.stall_text(meta, timeout, final=True))

    def stall_text(self, meta: Meta, waited: float, final: bool) -> str:
        """Who has not submitted ``meta`` after ``waited`` s: the error's text when the
        wait gives up (``final``), else the warning's."""
        with self._lock:
            entry = self._table.get(meta.key)
            came = sorted(entry.metas) if entry else [self.rank]
            members = self.sets[meta.set_id][1].ranks if meta.set_id in self.sets else []
            joined = sorted(self._joined)
            running = meta.key in self._running
        missing = [r for r in members if r not in came and r not in joined]
        head = (f"{meta.kind} {meta.name!r} did not complete within {waited:g} s" if final else
                f"{meta.kind} {meta.name!r} has waited {waited:.0f} s")
        tail = ("RINGTRAIN_STALL_TIMEOUT sets the limit" if final else
                "still waiting (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS or RINGTRAIN_STALL_TIMEOUT "
                "ends such a wait with an error; HOROVOD_STALL_CHECK_DISABLE=1 silences this)")
        if running:
            # Every member submitted it: the wait is in the backend's transfer, not in
            # the negotiation (naming a "missing" rank here would send the user astray).
            return (f"{head}: every member of process set {meta.set_id} (ranks {members}) submitted "
                    "it and its transfer on the backend has not finished (a peer that stopped "
                    f"answering, or a lost connection); {tail}")
        return (f"{head}: submitted by rank(s) {came}, still missing rank(s) "
                f"{missing or 'none (the job stopped)'}; every member of the process set must submit "
                f"it ({tail})")

    # -- the cycle thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._device is not None:
                torch.cuda.set_device(self._device)  # per thread (see __init__)
            for k in itertools.count():
                if not self._wait_for_cycle(k) or self._aborted:
                    return
                if self._cycle_once(k):
                    return
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting handle
            log.debug("coordinator failed", exc_info=True)
            self._fail_all(exc)

    def _wait_for_cycle(self, k: int) -> bool:
        # Long waits: every submission, join and shutdown sets the key, so a timeout only
        # means an idle hour (and each store timeout logs a warning).
        while not self._waker.wait(k, 3600.0):
            if self._stopping_local and self._failed is not None:
                return False
        return True

    def _cycle_once(self, k: int) -> bool:
        """One cycle; True when every rank has stopped."""
        with self._lock:
            batch, self._outbox = self._outbox, []
            self._cycle = k + 1
            flags = (self._joined_local, self._stopping_local)
        self.trace.cycle_start()
        # Held tensors (not torch's all_gather_object): this gather also runs at exit.
        gathered = inflight.gather_objects((batch, flags), group=self.control)
        if self.rank == 0:
            self._waker.done(k)  # every rank is past waiting for it
        stopping = 0
        with self._lock:
            for r, (metas, (joined, stop)) in enumerate(gathered):
                for meta in metas:
                    entry = self._table.get(meta.key)
                    if entry is None:
                        entry = self._table[meta.key] = _Entry(next(self._order))
                    entry.metas[r] = meta
                if joined and r not in self._joined:
                    self._joined.add(r)
                    self._last_joined = r
                stopping += bool(stop)
            work = self._decide()
        self._execute(work)
        self._finish_join()
        return stopping == self.size

    def _decide(self) -> list[tuple[str, list[tuple[Meta, dict[int, Meta]]], str | None]]:
        """Under the lock: what runs this cycle, in order, as (kind, [(meta, metas)], error)."""
        ready: list[tuple[int, tuple[int, str], _Entry, str | None]] = []
        for key, entry in self._table.items():
            name = key[1]
            first = entry.metas[min(entry.metas)]
            members = self.sets[first.set_id][1].ranks if first.set_id in self.sets else None
            if members is None:
                if first.set_id >= self._next_set_id:
                    # A faster rank registered the set and already used it; this rank's
                    # add_process_set is on its way (it is collective): wait for it, as
                    # for a member that has not submitted yet.
                    continue
                ready.append((entry.order, key, entry,
                              f"process set {first.set_id} of {name!r} is not registered on every rank"))
                continue
            joined = [r for r in members if r in self._joined and r not in entry.metas]
            waiting = [r for r in members if r not in entry.metas and r not in self._joined]
            if waiting:
                continue
            refused = [m.refused for m in entry.metas.values() if m.refused]
            error = refused[0] if refused else mismatch(entry.metas)
            if error is None and joined and first.kind not in REDUCING + ("barrier",):
                error = (f"{first.kind} {name!r} is not supported after join(): rank(s) {joined} "
                         "joined; only allreduce, reducescatter and barrier continue with joined ranks"
                         + ("; a DistributedOptimizer gathers sparse gradients: pass it "
                            "sparse_as_dense=True (as Horovod asks)" if first.kind == "allgather" else ""))
            if error is None and first.kind == "broadcast" and first.root not in members:
                error = (f"broadcast {name!r}: root rank {first.root} is not a member of the process "
                         f"set (ranks {members})")
            ready.append((entry.order, key, entry, error))
        ready += self._refused_groups(ready)
        ready.sort(key=lambda x: x[0])
        work: list[tuple[str, list[tuple[Meta, dict[int, Meta]]], str | None]] = []
        fused_bytes = 0
        for _, key, entry, error in ready:
            del self._table[key]
            first = entry.metas[min(entry.metas)]
            item = (first, dict(entry.metas))
            last = work[-1] if work else None
            if (error is None and last is not None and last[2] is None and last[0] == "allreduce"
                    and fusable(last[1][0][0], first) and fused_bytes + first.nbytes <= self.fusion_bytes):
                last[1].append(item)
                fused_bytes += first.nbytes
            else:
                work.append((first.kind, [item], error))
                fused_bytes = first.nbytes
        return work

    def _refused_groups(self, ready: list[tuple[int, tuple[int, str], _Entry, str | None]]
                        ) -> list[tuple[int, tuple[int, str], _Entry, str | None]]:
        """Under the lock: the other members of grouped calls a rank refused, with its error.

        A rank that refused a grouped call (an empty list, say) cannot know how many
        tensors the others passed, so members it did not name would wait for it for ever.
        A group's members reach every rank in one cycle (:meth:`submit_many`), so when one
        is decided refused, the others of the call are all in the table."""
        refused = {(key[0], _group_of(key[1])): error for _, key, entry, error in ready
                   if error is not None and _group_of(key[1]) and any(m.refused for m in entry.metas.values())}
        if not refused:
            return []
        decided = {key for _, key, _, _ in ready}
        return [(entry.order, key, entry, refused[(key[0], _group_of(key[1]))])
                for key, entry in self._table.items()
                if key not in decided and (key[0], _group_of(key[1])) in refused]

    def _execute(self, work: list[tuple[str, list[tuple[Meta, dict[int, Meta]]], str | None]]) -> None:
        for kind, items, error in work:
            first, _ = items[0]
            group = self.sets[first.set_id][1] if first.set_id in self.sets else None
            mine = [self._pending.get(m.key) if self.rank in metas else None for m, metas in items]
            if error is not None:
                for h in mine:
                    if h is not None:
                        self._complete(h, error=MismatchError(error) if error.startswith("Mismatched")
                                       else NegotiationError(error))
                continue
            assert group is not None
            if self.rank not in group.ranks:
                continue  # not a member: the members run it
            t0 = time.perf_counter()
            keys = {m.key for m, _ in items}
            with self._lock:
                self._running |= keys
            devices = {d for d in (_cuda_device(h.request) if h is not None else None for h in mine)
                       if d is not None}
            try:
                for h in mine:
                    req = h.request if h is not None else None
                    if req is not None and req.ready is not None:
                        assert req.tensor is not None
                        torch.cuda.current_stream(req.tensor.device).wait_event(req.ready)
                results = self._run_op(kind, group, items, mine)
                done = {d: _record(d) for d in devices}
            except Exception as exc:  # noqa: BLE001 - the op's error goes to its handles
                with self._lock:
                    self._running -= keys
                for h in mine:
                    if h is not None:
                        self._complete(h, error=CollectiveError(
                            f"{kind} of {h.meta.name!r} failed on rank {self.rank}: {first_line(exc, None)}"))
                continue
            t1 = time.perf_counter()
            with self._lock:
                self._running -= keys
            for h, res in zip(mine, results, strict=True):
                if h is not None:
                    self.trace.ran(h.meta, h.submitted_at, t0, t1)
                    dev = _cuda_device(h.request)
                    self._complete(h, result=res, done=(dev, done[dev]) if dev is not None else None)

    def _run_op(self, kind: str, group: Group, items: list[tuple[Meta, dict[int, Meta]]],
                mine: list[PendingOp | None]) -> list[Any]:
        reqs = [h.request if h is not None else None for h in mine]
        meta, metas = items[0]
        if kind == "allreduce":
            return execute.allreduce_fused(group, [m for m, _ in items], reqs)
        if kind == "barrier":
            return [None]
        req = reqs[0]
        if kind == "reducescatter":
            return [execute.reducescatter(group, req, meta, self.rank)]
        assert req is not None  # the others need every member, so this rank submitted
        if kind == "allgather":
            return [execute.allgather(group, metas, req)]
        if kind == "broadcast":
            return [execute.broadcast(group, meta.root, req)]
        if kind == "alltoall":
            return [execute.alltoall(group, metas, req, self.rank)]
        raise CollectiveError(f"unknown operation {kind!r}")

    def _complete(self, handle: PendingOp, result: Any = None, error: BaseException | None = None,
                  done: tuple[torch.device, Any] | None = None) -> None:
        with self._lock:
            if self._pending.get(handle.meta.key) is handle:
                del self._pending[handle.meta.key]
        handle._finish(result, error, done)

    def _finish_join(self) -> None:
        with self._lock:
            if len(self._joined) < self.size:
                return
            last, handle = self._last_joined, self._join_handle
            self._joined = set()
            self._joined_local = False
            self._join_handle = None
        if handle is not None:
            handle._finish(last)

    def fail_pending(self, reason: str) -> None:
        """End every operation still pending with a CollectiveError (the world is over);
        the cycle thread is left to :meth:`abort` or :meth:`shutdown`."""
        self._fail_all(CollectiveError(reason))

    def _fail_all(self, exc: BaseException) -> None:
        runtime.mark_broken(f"the coordinator stopped: {exc}")
        with self._lock:
            self._failed = exc
            handles = list(self._pending.values()) + ([self._join_handle] if self._join_handle else [])
            self._pending.clear()
        for h in handles:
            h._finish(error=CollectiveError(f"the coordinator stopped on rank {self.rank}: {first_line(exc, None)}"))



def _cuda_device(request: Request | None) -> torch.device | None:
    """The GPU of a request's tensor (None: no request, or a CPU tensor)."""
    t = request.tensor if request is not None else None
    return t.device if t is not None and t.device.type == "cuda" else None


def _record(device: torch.device) -> Any:
    """An event at the current point of this thread's stream on ``device``.

    Streams are per thread: the script's thread may be on a side stream, the cycle
    thread is on the default one. Each side marks where its writes end and the other
    side's stream waits for the mark (no host synchronisation)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _group_of(name: str) -> str:
    """The grouped call an operation belongs to (``grouped_allreduce.x`` for
    ``grouped_allreduce.x.3``, as ringtrain.horovod names a group's members), or ""."""
    base, _, index = name.rpartition(".")
    return base if name.startswith("grouped_") and index.isdigit() else ""


class _Waker:
    """How a submission wakes every rank's cycle thread for cycle ``k``."""

    def signal(self, k: int) -> None:
        raise NotImplementedError

    def wait(self, k: int, timeout: float) -> bool:
        raise NotImplementedError

    def done(self, k: int) -> None:
        """Cycle ``k`` has started everywhere (called on rank 0)."""


class _StoreWaker(_Waker):
    """A store key per cycle; waiting on it blocks in the store server, no spinning."""

    def __init__(self, connect: Callable[[], dist.Store]) -> None:
        self._submit = dist.PrefixStore("ringtrain/coordinator/", connect())
        self._thread = dist.PrefixStore("ringtrain/coordinator/", connect())

    def signal(self, k: int) -> None:
        self._submit.set(f"c/{k}", "1")

    def wait(self, k: int, timeout: float) -> bool:
        try:
            self._thread.wait([f"c/{k}"], datetime.timedelta(seconds=timeout))
            return True
        except RuntimeError as exc:
            if classify(exc) is not Failure.TIMEOUT:
                raise
            return False

    def done(self, k: int) -> None:
        self._thread.delete_key(f"c/{k}")


class _LocalWaker(_Waker):
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._wanted: set[int] = set()

    def signal(self, k: int) -> None:
        with self._cond:
            self._wanted.add(k)
            self._cond.notify_all()

    def wait(self, k: int, timeout: float) -> bool:
        with self._cond:
            if self._cond.wait_for(lambda: k in self._wanted, timeout):
                self._wanted.discard(k)
                return True
            return False
