"""The coordinator's timeline: a Chrome trace (``chrome://tracing``, Perfetto) of each
named operation, as Horovod's ``hvd.start_timeline`` writes it.

Each operation name gets its own track; its ``NEGOTIATE_<KIND>`` span runs from the
submission until every member had submitted it, and its ``<KIND>`` span covers the
transfer. ``mark_cycles`` adds an instant ``CYCLE_START`` event per cycle.

Rank 0 writes the file as Horovod's writer does: a JSON array whose first event carries
``start_time_since_epoch_in_micros``, each event appended as it happens and the closing
``]`` written after it, so the file is valid JSON whenever the job ends (killed, crashed,
no ``hvd.shutdown()``) and a long job's events are on disk, not in memory. The other
ranks record nothing; recording costs nothing while stopped.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ringtrain.horovod._coordinator.requests import Meta
from ringtrain.observe.timeline import live_writer

__all__ = ["Trace"]


class Trace:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._file: IO[bytes] | None = None
        self._mark_cycles = False
        self._tids: dict[str, int] = {}
        self._t0 = 0.0
        self._unregister: Callable[[], None] | None = None

    @property
    def active(self) -> bool:
        return self._path is not None

    def start(self, path: str | os.PathLike[str], mark_cycles: bool = False) -> None:
        with self._lock:
            if self._path is not None and Path(path) == self._path:
                return  # Horovod: starting the same timeline again is a no-op
            self._close()
            self._path = Path(path)
            self._mark_cycles = bool(mark_cycles)
            self._tids = {}
            self._t0 = time.perf_counter()
            if self.rank != 0:
                return
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self._path, "wb")  # noqa: SIM115 - open until stop()
            epoch = int(time.time() * 1e6)
            self._file.write(b"[\n" + _line({"name": "process_name", "ph": "M", "pid": 0,
                                              "args": {"start_time_since_epoch_in_micros": epoch,
                                                       "name": "Horovod timeline"}}) + b"]")
            self._file.flush()
            # ringtrain's own timeline written to this path (horovodrun
            # --timeline-filename asks for both) ends this file first, then keeps its events.
            self._unregister = live_writer(self._path, self.stop)

    def stop(self) -> Path | None:
        """Stop recording; the path rank 0 wrote (None on other ranks, or if stopped)."""
        with self._lock:
            path, written = self._path, self._file is not None
            self._close()
            self._path = None
        return path if written else None

    def _close(self) -> None:
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _append(self, events: list[dict[str, Any]]) -> None:
        """Write ``events`` before the closing bracket, which follows them again (a valid
        JSON array after every write, as Horovod's writer leaves it). Under the lock."""
        f = self._file
        if f is None or not events:
            return
        f.seek(-1, os.SEEK_END)
        f.write(b",\n" + b",\n".join(_line(e) for e in events) + b"]")
        f.flush()

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _tid(self, name: str, out: list[dict[str, Any]]) -> int:
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids) + 1
            out.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}})
        return tid

    def submitted(self, meta: Meta) -> None:
        """Nothing to record yet: the span is written when the operation ran."""

    def cycle_start(self) -> None:
        if self._file is None or not self._mark_cycles:
            return
        with self._lock:
            self._append([{"ph": "i", "name": "CYCLE_START", "pid": 0, "tid": 0, "s": "g",
                           "ts": self._us(time.perf_counter())}])

    def ran(self, meta: Meta, submitted: float, started: float, ended: float) -> None:
        if self._file is None:
            return
        kind = meta.kind.upper()
        with self._lock:
            if self._file is None:
                return
            events: list[dict[str, Any]] = []
            tid = self._tid(meta.name, events)
            events.append({"ph": "X", "name": f"NEGOTIATE_{kind}", "pid": 0, "tid": tid,
                           "ts": self._us(max(submitted, self._t0)),
                           "dur": self._us(started) - self._us(max(submitted, self._t0))})
            events.append({"ph": "X", "name": kind, "pid": 0, "tid": tid,
                           "ts": self._us(started), "dur": self._us(ended) - self._us(started),
                           "args": {"shape": list(meta.shape), "dtype": meta.dtype}})
            self._append(events)


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(", ", ": ")).encode()
