"""The stall tracker writes a rank's latest arrival before the rank leaves.

A peer whose exchange fails because this rank left reads where it last was; an arrival
still queued for the reporter thread at that moment would name the exchange before.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from ringtrain.signing import Signer
from ringtrain.sync.stall import Arrival, Tracker

KEY = "ringtrain/sync/stall/last/0"
GONE = "ringtrain/sync/stall/gone/0"


class _SlowStore(dist.HashStore):
    """A store whose writes take a while, as a loaded rank 0's store does."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.order: list[tuple[str, str]] = []  # (key, value) as each write finished
        self._lock = threading.Lock()

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        time.sleep(self.delay)
        super().set(key, value)
        with self._lock:
            self.order.append((key, value if isinstance(value, str) else value.decode()))


def _last(store: dist.Store, signer: Signer) -> Arrival:
    assert store.check([KEY]), "no arrival written"  # get() would wait for it
    raw = signer.open(KEY, store.get(KEY))
    assert raw is not None
    return Arrival.from_json(raw)


def test_close_writes_the_latest_arrival_first() -> None:
    store, signer = _SlowStore(0.2), Signer()
    tracker = Tracker(store, 0, 2, signer)
    for _ in range(3):
        tracker.arrive("bucket1")
    tracker.close()
    last = _last(store, signer)
    assert (last.name, last.count, last.seq) == ("bucket1", 3, 2), last


def test_exit_mark_comes_after_the_latest_arrival() -> None:
    store, signer = _SlowStore(0.2), Signer()
    tracker = Tracker(store, 0, 2, signer)
    tracker.arrive("bucket0")
    time.sleep(0.05)  # the reporter is writing bucket0: bucket1 waits its turn
    tracker.arrive("bucket1")
    tracker.mark_gone()
    last = _last(store, signer)
    assert (last.name, last.count, last.seq) == ("bucket1", 1, 1), last
    assert signer.open(GONE, store.get(GONE)) == "1"
    keys = [k for k, _ in store.order]
    assert keys[-1] == GONE and "bucket1" in store.order[-2][1], store.order


def test_close_is_bounded_when_the_store_hangs() -> None:
    store = _SlowStore(30.0)
    tracker = Tracker(store, 0, 2, Signer())
    tracker.arrive("bucket0")
    started = time.monotonic()
    tracker.close(0.3)
    assert time.monotonic() - started < 5.0
