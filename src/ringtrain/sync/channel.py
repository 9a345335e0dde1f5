"""The point-to-point channel ring and ps run on: a private Gloo group and one thread.

Why a private group: with Gloo a process group runs its operations in the order they
are issued, so p2p traffic issued from a background thread on the default group could
interleave with the collectives the main thread issues there, in a different order on
each rank. A group of our own keeps the two streams apart. It is built directly as a
``ProcessGroupGloo`` on a key prefix of the job's store, not with ``dist.new_group``:
``new_group`` numbers groups by a process-wide counter, so any other code calling it in
a different order on some rank would pair up the wrong groups.

Why a thread: ring and ps are many rounds of send/receive, each waiting for the one
before. Run in the caller they would block backward for the whole exchange; on one
exchange thread per process they overlap with it (torch releases the GIL while it waits
on Gloo and while it adds tensors). Exchanges run one at a time, in the order they were
submitted; every rank submits the same exchanges in the same order (the optimizer
launches buckets in plan order), so the rounds line up across ranks.

A caller that waits for an exchange which is next in line while the thread is idle runs
it itself (:meth:`Channel.run_if_next`): same order, two thread hand-offs fewer. Each
hand-off is a wake-up, and on a busy machine a wake-up can cost a whole time slice
(measured: a synchronous 4 KB ring allreduce took ~3 ms with hand-offs on a loaded
2-core machine, against ~0.5 ms for Gloo's own allreduce).

The group is created inside the first exchange, with that exchange's stall timeout
for the rendezvous: a rank that never arrives shows up as a StallError at the first
exchange, not as a hang for the init timeout.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ringtrain import runtime
from ringtrain.sync._tensors import ScratchPool

__all__ = ["Channel", "Op", "PeerError", "channel", "close"]

log = logging.getLogger("ringtrain")

T = TypeVar("T")

_STORE_PREFIX = "ringtrain/sync/p2p/"


class PeerError(RuntimeError):
    """A send or receive failed; ``peer`` is the rank on the other side."""

    def __init__(self, peer: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.peer = peer


class Op:
    """A send or receive in flight; :meth:`wait` names the peer when it fails."""

    __slots__ = ("work", "peer", "timeout")

    def __init__(self, work: Any, peer: int, timeout: datetime.timedelta) -> None:
        self.work = work
        self.peer = peer
        self.timeout = timeout

    def wait(self) -> None:
        try:
            self.work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(self.peer, exc) from exc


class Channel:
    """A private Gloo group over all ranks plus the thread that runs exchanges on it."""

    def __init__(self, rank: int, size: int, store: dist.Store, timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.scratch = ScratchPool()
        self._store = store
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._group: Any = None
        #: Bound on each send/receive wait, set per exchange to the strategy's stall
        #: timeout: the thread must not stay blocked in Gloo after the caller gave up
        #: (a thread blocked in Gloo at interpreter exit aborts the process).
        self.op_timeout = self._timeout
        self._cond = threading.Condition()
        self._pending: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._running = False  # a job is running (on the thread or in a caller)
        self._closed = False
        # A daemon thread: an exchange stuck on a dead peer must not keep the process alive.
        self._thread = threading.Thread(target=self._run, name="ringtrain-exchange", daemon=True)
        self._thread.start()

    # -- used by algorithms, on the exchange thread ------------------------------------

    @property
    def group(self) -> Any:
        if self._group is None:
            self._group = dist.ProcessGroupGloo(
                dist.PrefixStore(_STORE_PREFIX, self._store), self.rank, self.size, self.op_timeout
            )
        return self._group

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Op:
        return Op(self.group.send([tensor], dst, tag), dst, self.op_timeout)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Op:
        return Op(self.group.recv([tensor], src, tag), src, self.op_timeout)

    # -- used by callers -----------------------------------------------------------------

    def submit(self, fn: Callable[[], T], timeout_s: float | None = None) -> Future[T]:
        """Run ``fn`` on the exchange thread after every job submitted before it; its
        sends and receives give up after ``timeout_s`` (default: the group's timeout)."""
        fut: Future[T] = Future()
        op_timeout = self._timeout if timeout_s is None else datetime.timedelta(seconds=timeout_s)

        def job() -> T:
            self.op_timeout = op_timeout
            return fn()

        with self._cond:
            self._pending.append((job, fut))
            self._cond.notify_all()
        return fut

    def run_if_next(self, fut: Future[Any]) -> None:
        """Run the job of ``fut`` in the calling thread if it is next and nothing runs."""
        with self._cond:
            if self._running or not self._pending or self._pending[0][1] is not fut:
                return
            job = self._pending.popleft()
            self._running = True
        self._execute(job)

    def close(self) -> None:
        """Let the thread finish its queue, then release the group here.

        The group is dropped in the caller (``rt.shutdown``), while the job's store is
        still up, so Gloo's threads are joined now. Left to interpreter exit, the group
        could be destroyed while its threads were still joinable, which aborts the
        process ("terminate called without an active exception", seen at the end of
        benchmark runs). A thread stuck on a dead peer is not waited for beyond a bound.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(min(5.0, self._timeout.total_seconds()))
        if not self._thread.is_alive():
            self._group = None

    def _execute(self, item: tuple[Callable[[], Any], Future[Any]]) -> None:
        fn, fut = item
        try:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    fut.set_exception(exc)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._running or (not self._pending and not self._closed):
                    self._cond.wait()
                if not self._pending:
                    return  # closed and drained
                item = self._pending.popleft()
                self._running = True
            self._execute(item)


_lock = threading.Lock()
_current: tuple[object, Channel] | None = None


def channel() -> Channel:
    """The channel of the current world (made at first use, replaced after a re-init)."""
    global _current
    world = runtime.world()
    with _lock:
        if _current is not None and _current[0] is world:
            return _current[1]
        if _current is not None:
            _current[1].close()
        # The init timeout bounds only jobs submitted without a timeout; strategies
        # pass their stall_timeout with every exchange.
        ch = Channel(world.env.rank, world.env.size, runtime.store(), world.settings.init_timeout)
        _current = (world, ch)
        return ch


def close() -> None:
    """Drop the channel (its group is released when the exchange thread lets go of it)."""
    global _current
    with _lock:
        if _current is not None:
            _current[1].close()
            _current = None
