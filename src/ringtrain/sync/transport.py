"""Where ring and ps buffers live and how their messages move: host or device.

Ring and ps are written once (ring.py, ps.py) against a :class:`~ringtrain.sync.channel.Channel`;
a transport is the part that differs between a CPU tensor and a GPU tensor:

=============  =============================================================================
transport      buffers, group, and how a round's messages go out
=============  =============================================================================
Gloo           host memory; a private ``ProcessGroupGloo``; every send and receive is
               posted on its own and matched by tag, so receives can go out rounds before
               the matching send (``lockstep = False``): Gloo's sender waits for the
               receiver's "ready" note, and a receive posted early hides that round trip.
NCCL           the tensor's own GPU (no copy to host); a process group of NCCL; a round's
               sends and receives go out together as one ``dist.batch_isend_irecv``
               (``lockstep = True``).
=============  =============================================================================

Why NCCL needs lockstep rounds: its point-to-point operations ignore tags and run, batch
after batch, on one stream per rank. A batch finishes only when every one of its
messages has met its partner, so a receive posted in a batch ahead of the partner's
send (in a later batch of the peer) would block the stream forever. When every rank
issues the same sequence of batches and every message's partner sits in the batch of
the same index on the other rank, the earliest unfinished batch can always finish: no
deadlock. ``tests/unit/sync/sync_fakes.py`` checks the algorithms against exactly this
rule on CPU.

Why a device transport runs on a side stream: the exchange thread must not touch the
caller's stream while backward still queues work on it. :meth:`NcclTransport.ready`
records an event on the caller's stream when the exchange is submitted; the job waits
for it on the transport's own stream, and its end is an event the exchange thread polls
against the stall timeout, so a peer that never comes is a StallError, not a hang.

The NCCL group is made with ``dist.new_group``, the documented way to get a group that
``batch_isend_irecv`` accepts. ``new_group`` must be called by every rank in the same
order; it is called at the first exchange of a CUDA tensor by ring or ps, in the thread
that submits it, which is the same point of the program on every rank.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ringtrain import inflight

__all__ = ["Msg", "Op", "PeerError", "Transport", "GlooTransport", "NcclTransport", "wait_event"]

#: (tensor, peer rank, tag): one message of a round. NCCL ignores the tag.
Msg = tuple[torch.Tensor, int, int]

_STORE_PREFIX = "ringtrain/sync/p2p/"


class PeerError(RuntimeError):
    """A send or receive failed; ``peer`` is the rank on the other side."""

    def __init__(self, peer: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.peer = peer


class Op:
    """A posted message; :meth:`wait` names the peer when it fails.

    On a host transport ``wait`` blocks until the message has moved (bounded by
    ``timeout``). On a device transport it only orders the current stream after the
    transfer (``timeout`` None), as NCCL's ``Work.wait()`` does; the end of the whole
    exchange is then awaited by :func:`wait_event`.
    """

    __slots__ = ("work", "peer", "timeout")

    def __init__(self, work: Any, peer: int, timeout: datetime.timedelta | None) -> None:
        self.work = work
        self.peer = peer
        self.timeout = timeout

    def wait(self) -> None:
        try:
            if self.timeout is None:
                self.work.wait()
            else:
                self.work.wait(self.timeout)
        except RuntimeError as exc:
            raise PeerError(self.peer, exc) from exc


class Transport(Protocol):
    """What a channel needs from the buffers' side of an exchange."""

    #: Where exchanged buffers (the flat tensor, scratch space) live.
    device: torch.device
    #: True: each round's receives go out with its sends, in one batch (NCCL).
    lockstep: bool

    def start(self, sends: Sequence[Msg], recvs: Sequence[Msg],
              timeout: datetime.timedelta) -> tuple[list[Op], list[Op]]:
        """Post one round's messages; (send ops, receive ops) in the given order."""

    def ready(self) -> Any:
        """Called in the submitting thread: what the job must wait for before it starts."""

    def run(self, job: Callable[[], None], ticket: Any, timeout_s: float) -> None:
        """Run ``job`` (the exchange) where its buffers live and wait until it is done."""

    def close(self) -> None:
        """Release the group (after the exchange thread let go of it)."""


class GlooTransport:
    """Host memory over a private Gloo group built on a key prefix of the job's store.

    The group is not made with ``dist.new_group``, which numbers groups by a process-wide
    counter: other code making groups in a different order on some rank would pair the
    wrong ones. It is made at the first exchange, with that exchange's stall timeout
    for the rendezvous, so a rank that never comes is a StallError, not a hang.
    """

    lockstep = False

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        self.device = torch.device("cpu")
        self._store = store
        self._rank = rank
        self._size = size
        self._group: Any = None

    def _group_for(self, timeout: datetime.timedelta) -> Any:
        if self._group is None:
            self._group = dist.ProcessGroupGloo(
                dist.PrefixStore(_STORE_PREFIX, self._store), self._rank, self._size, timeout
            )
        return self._group

    def start(self, sends: Sequence[Msg], recvs: Sequence[Msg],
              timeout: datetime.timedelta) -> tuple[list[Op], list[Op]]:
        group = self._group_for(timeout)
        # The pieces are views made per round: keep them until Gloo lets go (ringtrain.inflight).
        inflight.hold(*(t for t, _, _ in recvs), *(t for t, _, _ in sends))
        # Receives first: a receive that is posted lets the peer's data flow at once.
        received = [Op(group.recv([t], src, tag), src, timeout) for t, src, tag in recvs]
        sent = [Op(group.send([t], dst, tag), dst, timeout) for t, dst, tag in sends]
        return sent, received

    def ready(self) -> None:
        return None

    def run(self, job: Callable[[], None], ticket: Any, timeout_s: float) -> None:
        job()

    def close(self) -> None:
        self._group = None


class NcclTransport:
    """The GPU's memory over an NCCL group; rounds go out as batches (see module doc)."""

    lockstep = True

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        if device.type != "cuda":
            raise ValueError(f"NCCL moves CUDA tensors, got a tensor on {device}")
        self.device = device
        # Every rank makes this group at its first CUDA ring/ps exchange (module doc).
        self._group: Any = dist.new_group(backend="nccl",
                                          timeout=datetime.timedelta(seconds=timeout_s))
        self._stream = torch.cuda.Stream(device)

    def start(self, sends: Sequence[Msg], recvs: Sequence[Msg],
              timeout: datetime.timedelta) -> tuple[list[Op], list[Op]]:
        if not sends and not recvs:
            return [], []
        # The group spans every rank in rank order, so global and group ranks agree.
        ops = [dist.P2POp(dist.irecv, t, peer=src, group=self._group) for t, src, _ in recvs]
        ops += [dist.P2POp(dist.isend, t, peer=dst, group=self._group) for t, dst, _ in sends]
        inflight.hold(*(t for t, _, _ in recvs), *(t for t, _, _ in sends))
        works = [w for w in dist.batch_isend_irecv(ops) if w is not None]
        # The batch may come back as one work for all its messages (NCCL coalesces
        # them); waiting for a message means waiting for its batch.
        batch = _Batch(works)
        return ([Op(batch, dst, None) for _, dst, _ in sends],
                [Op(batch, src, None) for _, src, _ in recvs])

    def ready(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def run(self, job: Callable[[], None], ticket: Any, timeout_s: float) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(ticket)  # the gradients the caller queued are there
            job()
            done = torch.cuda.Event()
            done.record(self._stream)
        wait_event(done, timeout_s)

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)


class _Batch:
    """The works of one ``batch_isend_irecv``, waited for together."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        for work in self.works:
            work.wait()


def wait_event(event: Any, timeout_s: float) -> None:
    """Wait until a CUDA event has happened, giving up after ``timeout_s``.

    Polled, not ``event.synchronize()``: a kernel stuck on a peer that never comes
    never ends, and the wait must stay bounded by the stall timeout. The message says
    "timed out", which the stall inspection turns into a StallError naming the ranks.
    """
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise RuntimeError(f"device exchange timed out after {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
