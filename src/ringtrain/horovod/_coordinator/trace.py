"""The coordinator's timeline: a Chrome trace (``chrome://tracing``, Perfetto) of each
named operation, as Horovod's ``hvd.start_timeline`` writes it.

Each operation name gets its own track; its ``NEGOTIATE_<KIND>`` span runs from the
submission until every member had submitted it, and its ``<KIND>`` span covers the
transfer. ``mark_cycles`` adds an instant ``CYCLE_START`` event per cycle. Rank 0 writes
the file (atomically, at :meth:`Trace.stop`); recording costs nothing while stopped.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ringtrain.horovod._coordinator.requests import Meta

__all__ = ["Trace"]


class Trace:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._mark_cycles = False
        self._events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._t0 = 0.0
        self._epoch_us = 0

    @property
    def active(self) -> bool:
        return self._path is not None

    def start(self, path: str | os.PathLike[str], mark_cycles: bool = False) -> None:
        with self._lock:
            if self._path is not None and Path(path) == self._path:
                return  # Horovod: starting the same timeline again is a no-op
            self._path = Path(path)
            self._mark_cycles = bool(mark_cycles)
            self._events = []
            self._tids = {}
            self._t0 = time.perf_counter()
            self._epoch_us = int(time.time() * 1e6)

    def stop(self) -> Path | None:
        with self._lock:
            path, events = self._path, self._events
            self._path, self._events = None, []
            epoch = self._epoch_us
        if path is None or self.rank != 0:
            return None
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "metadata": {"start_time_since_epoch_in_micros": epoch, "rank": self.rank}}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        return path

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _tid(self, name: str) -> int:
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids) + 1
            self._events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                                 "args": {"name": name}})
        return tid

    def submitted(self, meta: Meta) -> None:
        """Nothing to record yet: the span is written when the operation ran."""

    def cycle_start(self) -> None:
        if self._path is None or not self._mark_cycles:
            return
        with self._lock:
            if self._path is not None:
                self._events.append({"ph": "i", "name": "CYCLE_START", "pid": 0, "tid": 0, "s": "g",
                                     "ts": self._us(time.perf_counter())})

    def ran(self, meta: Meta, submitted: float, started: float, ended: float) -> None:
        if self._path is None:
            return
        kind = meta.kind.upper()
        with self._lock:
            if self._path is None:
                return
            tid = self._tid(meta.name)
            self._events.append({"ph": "X", "name": f"NEGOTIATE_{kind}", "pid": 0, "tid": tid,
                                 "ts": self._us(max(submitted, self._t0)),
                                 "dur": self._us(started) - self._us(max(submitted, self._t0))})
            self._events.append({"ph": "X", "name": kind, "pid": 0, "tid": tid,
                                 "ts": self._us(started), "dur": self._us(ended) - self._us(started),
                                 "args": {"shape": list(meta.shape), "dtype": meta.dtype}})
