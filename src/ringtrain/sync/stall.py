"""Stall inspection: when an exchange does not finish, say which ranks are missing.

Every exchange a strategy launches is an *arrival*: a sequence number (the n-th exchange
of this process; equal across ranks because every rank exchanges the same tensors in
the same order), the tensor's name and how many times that name was exchanged (for an
optimizer bucket: the step). The latest arrival of each rank is published to the job's
store by a reporter thread, coalesced, so the caller pays a lock and a notify, not a
network round trip. At exit a rank marks itself gone.

When a wait runs past ``stall_timeout`` or fails because a peer vanished, the waiting
rank reads everybody's latest arrival and raises :class:`~ringtrain.errors.StallError`
naming the ranks that never reached this exchange, where each of them last was, and
whether it exited, instead of hanging (Horovod's stall check does the same after 60 s).

:func:`describe_stall` builds the message from plain values and is unit-tested alone.
"""

from __future__ import annotations

import atexit
import datetime
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ringtrain import inflight, runtime
from ringtrain.errors import CollectiveError, StallError, first_line
from ringtrain.peer_failure import Failure, classify
from ringtrain.settings import env_name
from ringtrain.signing import Signer

__all__ = [
    "Arrival",
    "Tracker",
    "tracker",
    "describe_stall",
    "inspect",
    "wait_work",
    "wait_future",
    "failure",
    "close",
    "is_peer_failure",
]

T = TypeVar("T")

_PREFIX = "ringtrain/sync/stall/"


@dataclass(frozen=True)
class Arrival:
    """One exchange as launched by this rank."""

    seq: int  #: 0-based index of the exchange in this process
    name: str  #: what is exchanged (a bucket name, a tensor name, or a shape)
    count: int  #: how many times ``name`` was exchanged, this one included

    def label(self) -> str:
        return f"{self.name!r} for the {_ordinal(self.count)} time (exchange #{self.seq})"

    def to_json(self) -> str:
        return json.dumps([self.seq, self.name, self.count])

    @classmethod
    def from_json(cls, raw: bytes | str) -> Arrival:
        seq, name, count = json.loads(raw)
        return cls(int(seq), str(name), int(count))


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def describe(name: str | None, tensor: torch.Tensor | None) -> str:
    if name:
        return name
    if tensor is not None:
        return f"unnamed tensor {tuple(tensor.shape)} {str(tensor.dtype).replace('torch.', '')}"
    return "unnamed tensor"


class Tracker:
    """Counts this rank's exchanges and publishes the latest one to the store."""

    def __init__(self, store: dist.Store, rank: int, size: int, signer: Signer | None = None) -> None:
        self.store = store
        self.signer = signer or Signer()
        self.rank = rank
        self.size = size
        self._seq = 0
        self._counts: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._pending: str | None = None  # the latest arrival not yet written
        self._written = True
        self._closed = False
        self._thread = threading.Thread(target=self._report, name="ringtrain-stall", daemon=True)
        inflight.track(self._thread)  # it writes to the store: joined at exit once closed
        self._thread.start()
        atexit.register(self.mark_gone)

    def arrive(self, name: str | None, tensor: torch.Tensor | None = None) -> Arrival:
        label = describe(name, tensor)
        with self._cond:
            self._counts[label] += 1
            arrival = Arrival(self._seq, label, self._counts[label])
            self._seq += 1
            self._pending = arrival.to_json()
            self._written = False
            self._cond.notify()
        return arrival

    def _report(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed or self._pending is None:
                    return
                value, self._pending = self._pending, None
            try:
                key = f"{_PREFIX}last/{self.rank}"
                self.store.set(key, self.signer.seal(key, value))
            except Exception:  # noqa: BLE001 - store gone (rank 0 exited): stop reporting
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            with self._cond:
                if self._pending is None:
                    self._written = True
                    self._cond.notify_all()

    def flush(self, timeout: float) -> None:
        """Wait until the latest arrival is in the store (bounded)."""
        with self._cond:
            self._cond.wait_for(lambda: self._written or self._closed, timeout)

    def close(self, flush_s: float = 1.0) -> None:
        """Stop publishing, once the latest arrival is written (up to ``flush_s``: the
        store may hang). A peer whose exchange then fails because this rank left names
        the exchange this rank reached, not the one before it."""
        self.flush(flush_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def mark_gone(self) -> None:
        """Tell the others this process is leaving (at exit; bounded, best effort)."""
        if self._closed:
            return  # replaced by a newer world's tracker, or the store is gone
        self.flush(1.0)  # the last arrival before the mark (see close)
        try:
            key = f"{_PREFIX}gone/{self.rank}"
            _bounded(lambda: self.store.set(key, self.signer.seal(key, "1")), 1.0)
        except Exception:  # noqa: BLE001 - the store is gone too; nothing to tell
            pass
        self.close(0.0)


_lock = threading.Lock()
_current: tuple[object, Tracker] | None = None


def tracker() -> Tracker:
    """The tracker of the current world (made at first use, replaced after a re-init)."""
    global _current
    world = runtime.world()
    with _lock:
        if _current is None or _current[0] is not world:
            if _current is not None:
                _current[1].close()
            _current = (world, Tracker(runtime.store(), world.env.rank, world.env.size,
                                       runtime.signer()))
        return _current[1]


def close() -> None:
    """Stop publishing arrivals (the next exchange starts a new tracker)."""
    global _current
    with _lock:
        if _current is not None:
            _current[1].close()
            _current = None


def _bounded(fn: Callable[[], T], seconds: float) -> T | None:
    """Run a store call on a helper thread and give up after ``seconds`` (returns None).

    Store calls can block for the store's own timeout (minutes) when rank 0 is stuck;
    an error report must not.
    """
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except Exception as exc:  # noqa: BLE001
            box.append((False, exc))

    t = threading.Thread(target=run, name="ringtrain-store-call", daemon=True)
    inflight.track(t)  # left in the store call past the bound: still joined at exit
    t.start()
    t.join(seconds)
    if not box:
        return None
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def describe_stall(
    rank: int,
    size: int,
    arrival: Arrival,
    last: Mapping[int, Arrival | None] | None,
    gone: set[int],
    waited_s: float,
    timeout_s: float,
    cause: str | None = None,
) -> str:
    """The StallError message. ``last`` maps each rank to its latest arrival (None: no
    exchange yet); ``last is None`` means the store could not be read."""
    if cause:
        head = (
            f"exchange of {arrival.label()} failed on rank {rank} after {waited_s:.1f} s "
            f"because a peer went away ({cause})"
        )
    else:
        head = (
            f"exchange of {arrival.label()} did not complete on rank {rank} within "
            f"{timeout_s:g} s (stall_timeout; raise it with {env_name('stall_timeout')} or "
            "stall_timeout= if a step legitimately takes longer)"
        )
    if last is None:
        return (
            f"{head}; rank 0, which hosts the job's store, cannot be reached, so it has "
            "probably exited: look at rank 0's log"
        )
    missing = []
    for r in range(size):
        if r == rank:
            continue
        rec = last.get(r)
        if rec is not None and rec.seq >= arrival.seq:
            continue  # reached this exchange (or launched later ones after it)
        where = f"last arrived at {rec.label()}" if rec is not None else "never reached an exchange"
        missing.append(f"rank {r} ({where}{'; exited' if r in gone else ''})")
    if not missing:
        return (
            f"{head}; every rank reached this exchange, so a rank is stuck inside it or in a "
            "collective outside ringtrain.sync (check that all ranks issue the same "
            "collectives in the same order)"
        )
    plural = "s" if len(missing) > 1 else ""
    return (
        f"{head}; missing rank{plural}: {', '.join(missing)}. Every rank must run the same "
        "steps and exchange the same tensors; look at the missing ranks' logs"
    )


def inspect(arrival: Arrival, waited_s: float, timeout_s: float, cause: str | None = None) -> StallError:
    """Read where every rank is and build the StallError for ``arrival`` (never raises)."""
    tr = tracker()
    # Give the others a moment: a peer that just died may still be writing its exit mark,
    # and a peer stalled at the same exchange publishes its arrival in microseconds.
    tr.flush(0.5)
    time.sleep(0.5)
    store = tr.store

    def read() -> tuple[dict[int, Arrival | None], set[int]]:
        last: dict[int, Arrival | None] = {}
        gone: set[int] = set()
        seal = tr.signer
        for r in range(tr.size):
            # A value without this job's seal was not written by a rank: ignored.
            key = f"{_PREFIX}last/{r}"
            raw = seal.open(key, store.get(key)) if store.check([key]) else None
            last[r] = Arrival.from_json(raw) if raw is not None else None
            gone_key = f"{_PREFIX}gone/{r}"
            if store.check([gone_key]) and seal.open(gone_key, store.get(gone_key)) == "1":
                gone.add(r)
        return last, gone

    try:
        got = _bounded(read, 5.0)
    except Exception:  # noqa: BLE001 - the store is unreachable
        got = None
    last, gone = got if got is not None else (None, set())
    error = StallError(describe_stall(tr.rank, tr.size, arrival, last, gone, waited_s, timeout_s, cause))
    runtime.mark_broken(str(error))
    return error


def is_peer_failure(exc: BaseException) -> bool:
    """Whether a failed wait means a peer went away (:mod:`ringtrain.peer_failure`)."""
    return classify(exc) is Failure.PEER_GONE


def _short(exc: BaseException) -> str:
    """Gloo's first sentence without its source path ("Connection closed by peer [addr]")."""
    first = first_line(exc, None)
    for marker in ("Connection", "Broken pipe", "Socket"):
        if marker in first:
            first = first[first.find(marker):]
            break
    return first.split(". ")[0].rstrip(".")[:160]


def failure(arrival: Arrival, exc: BaseException, started: float, timeout_s: float) -> Exception:
    """The error for a failed wait that started at ``started`` (time.monotonic())."""
    waited = time.monotonic() - started
    kind = classify(exc)
    if kind is Failure.PEER_GONE:
        peer = getattr(exc, "peer", None)
        cause = _short(exc)
        if peer is not None:
            cause = f"the connection to rank {peer} broke: {cause}"
        return inspect(arrival, waited, timeout_s, cause=cause)
    if kind is Failure.TIMEOUT:
        return inspect(arrival, waited, timeout_s)
    return CollectiveError(f"exchange of {arrival.label()} failed on rank {runtime.rank()}: {first_line(exc, None)}")


def wait_work(work: Any, arrival: Arrival, timeout_s: float) -> None:
    """Wait for a ``torch.distributed`` work object; a stall or peer loss is a StallError."""
    started = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise failure(arrival, exc, started, timeout_s) from None


def wait_future(fut: Future[T], arrival: Arrival, timeout_s: float) -> T:
    """Wait for an exchange running on the exchange thread, with the same reporting."""
    started = time.monotonic()
    try:
        return fut.result(timeout=timeout_s)
    except FutureTimeout:
        raise inspect(arrival, time.monotonic() - started, timeout_s) from None
    except CollectiveError:
        raise  # said by ringtrain itself (a channel an earlier failure ended)
    except RuntimeError as exc:
        raise failure(arrival, exc, started, timeout_s) from None
