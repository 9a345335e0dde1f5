"""The point-to-point channel ring and ps run on: a transport plus one exchange thread.

The transport (:mod:`ringtrain.sync.transport`) decides where buffers live and how a
round's messages go out: a private Gloo group on host memory for CPU tensors, an NCCL
group on the GPU for CUDA tensors under the NCCL backend. Everything else is this
module's and the algorithms', the same for both.

Why a private group: with Gloo a process group runs its operations in the order they
are issued, so p2p traffic issued from a background thread on the default group could
interleave with the collectives the main thread issues there, in a different order on
each rank. A group of our own keeps the two streams apart.

Why a thread: ring and ps are many rounds of send/receive, each waiting for the one
before. Run in the caller they would block backward for the whole exchange; on one
exchange thread per channel they overlap with it (torch releases the GIL while it waits
on Gloo and while it adds tensors). Exchanges run one at a time, in the order they were
submitted; every rank submits the same exchanges in the same order (the optimizer
launches buckets in plan order), so the rounds line up across ranks.

An exchange that fails on this rank (a peer that did not come within the stall
timeout, a lost connection) ends the channel: every later exchange submitted to it
fails at once with a :class:`~ringtrain.errors.CollectiveError` saying so. The failed
exchange's peers may still be sending its rounds, under the same tags the next exchange
receives on, so running another would add one exchange's pieces into another's
(different numbers on different ranks, and no error).

A caller that waits for an exchange which is next in line while the thread is idle runs
it itself (:meth:`Channel.run_if_next`): same order, two thread hand-offs fewer. Each
hand-off is a wake-up, and on a busy machine a wake-up can cost a whole time slice
(measured: a synchronous 4 KB ring allreduce took ~3 ms with hand-offs on a loaded
2-core machine, against ~0.5 ms for Gloo's own allreduce).
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from ringtrain import inflight, runtime
from ringtrain.errors import CollectiveError, first_line
from ringtrain.runtime.backend import nccl_op_timeout
from ringtrain.sync._tensors import ScratchPool
from ringtrain.sync.transport import GlooTransport, Msg, NcclTransport, Op, PeerError, Transport

__all__ = ["Channel", "Msg", "Op", "PeerError", "channel", "channel_device", "close"]

log = logging.getLogger("ringtrain")

T = TypeVar("T")


class Channel:
    """A transport over all ranks plus the thread that runs exchanges on it."""

    def __init__(self, rank: int, size: int, transport: Transport, timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.transport = transport
        #: Where buffers live: ``flat`` tensors handed to :meth:`start` and the scratch.
        self.device = transport.device
        #: True when each round's receives must go out with its sends (see transport.py).
        self.lockstep = transport.lockstep
        self.scratch = ScratchPool(transport.device)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        #: Bound on each send/receive wait, set per exchange to the strategy's stall
        #: timeout: the thread must not stay blocked in Gloo after the caller gave up
        #: (a thread blocked in Gloo at interpreter exit aborts the process).
        self.op_timeout = self._timeout
        self._cond = threading.Condition()
        self._pending: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._running = False  # a job is running (on the thread or in a caller)
        self._closed = False
        self._failed: BaseException | None = None  # the exchange that ended the channel
        # A daemon thread: an exchange stuck on a dead peer must not keep the process alive.
        self._thread = threading.Thread(target=self._run, name="ringtrain-exchange", daemon=True)
        inflight.track(self._thread)  # in Gloo while it exchanges: joined at exit once closed
        self._thread.start()

    # -- used by algorithms, on the exchange thread ------------------------------------

    def start(self, sends: Sequence[Msg] = (), recvs: Sequence[Msg] = ()) -> tuple[list[Op], list[Op]]:
        """Post one round's messages: (send ops, receive ops), each list in the given order."""
        return self.transport.start(sends, recvs, self.op_timeout)

    # -- used by callers -----------------------------------------------------------------

    def submit(self, fn: Callable[[], T], timeout_s: float | None = None) -> Future[T]:
        """Run ``fn`` on the exchange thread after every job submitted before it; its
        sends and receives give up after ``timeout_s`` (default: the channel's timeout).

        Call it after the buffers ``fn`` uses are written: a device transport starts the
        job only once the caller's stream has reached this point."""
        fut: Future[T] = Future()
        op_timeout = self._timeout if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        ticket = self.transport.ready()
        box: list[T] = []

        def job() -> T:
            self.op_timeout = op_timeout
            self.transport.run(lambda: box.append(fn()), ticket, op_timeout.total_seconds())
            return box[0]

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
            self.transport.close()

    def _execute(self, item: tuple[Callable[[], Any], Future[Any]]) -> None:
        fn, fut = item
        try:
            if fut.set_running_or_notify_cancel():
                if self._failed is not None:
                    fut.set_exception(self._ended())
                    return
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    self._failed = exc
                    fut.set_exception(exc)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _ended(self) -> CollectiveError:
        cause = first_line(self._failed, None) if self._failed is not None else "?"
        return CollectiveError(
            f"an earlier ring/ps exchange failed on rank {self.rank} "
            f"({cause}); its peers may still send its rounds, which "
            "this exchange would take for its own, so none runs on this process group again: "
            "end the job (ringrun --max-restarts restarts it from the last checkpoint)")

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
_current: tuple[object, dict[str, Channel]] | None = None


def channel_device(tensor: torch.Tensor) -> torch.device:
    """Where the exchange of ``tensor`` runs: its own GPU when the job's backend is NCCL,
    else host memory (Gloo; a CUDA tensor is then staged through the host)."""
    if tensor.device.type == "cuda" and runtime.world().backend == "nccl":
        return tensor.device
    return torch.device("cpu")


def channel(device: torch.device | str = "cpu") -> Channel:
    """The channel for buffers on ``device`` in the current world (made at first use,
    replaced after a re-init): Gloo for ``cpu``, NCCL for a CUDA device."""
    global _current
    dev = torch.device(device)
    world = runtime.world()
    with _lock:
        if _current is None or _current[0] is not world:
            if _current is not None:
                for old in _current[1].values():
                    old.close()
            _current = (world, {})
        channels = _current[1]
        ch = channels.get(str(dev))
        if ch is None:
            env = world.env
            transport: Transport
            if dev.type == "cpu":
                transport = GlooTransport(runtime.store(), env.rank, env.size)
            else:
                # Made here, in the submitting thread, at the same point of the program
                # on every rank (new_group's requirement; see transport.py).
                # Its watchdog's timeout comes after the stall check (backend.nccl_op_timeout).
                transport = NcclTransport(dev, nccl_op_timeout(world.settings))
            # The init timeout bounds only jobs submitted without a timeout; strategies
            # pass their stall_timeout with every exchange.
            ch = Channel(env.rank, env.size, transport, world.settings.init_timeout)
            channels[str(dev)] = ch
        return ch


def close() -> None:
    """Drop the channels (each group is released when its exchange thread lets go of it)."""
    global _current
    with _lock:
        if _current is not None:
            for ch in _current[1].values():
                ch.close()
            _current = None
