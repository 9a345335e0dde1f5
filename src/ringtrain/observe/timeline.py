"""The timeline: every step as a Chrome trace-event JSON (Perfetto, chrome://tracing).

Layout of a trace (the `Trace Event Format`_, JSON object form):

* one *process* per rank (``pid`` = rank, named "rank R"),
* thread ``1`` "steps": a complete event (``"ph": "X"``) per step with its phases
  (data_wait, h2d_copy, compute, exchange_wait, update) nested inside it,
* thread ``2`` "copies": copies overlapped on a side stream (they block nothing),
* threads ``10, 11, ...``: one per fusion bucket, a span from the exchange's launch
  (during backward) to its completion, with its bytes and tensor names.

Spans of one thread never overlap other than by nesting, so viewers draw them as
stacks. Times are wall-clock microseconds (``time.time()``-anchored), so the tracks of
ranks on different hosts line up as well as their clocks do.

Files: with one rank the trace goes to ``path``; with more, each rank writes
``<stem>.rank<R><suffix>`` (each a complete trace that opens alone) and rank 0 merges
the parts into ``path`` at exit, waiting up to :data:`MERGE_WAIT_S` for the others.
``ringtrain doctor`` merges again once every rank has exited.

A Horovod timeline (``HOROVOD_TIMELINE`` / ``hvd.start_timeline``, written by rank 0) at
the same path, as ``horovodrun --timeline-filename`` asks for both, is kept: its
``NEGOTIATE_<OP>`` / ``<OP>`` spans join the trace as one more process,
"Horovod timeline" (:func:`horovod_events`), instead of being replaced.

.. _Trace Event Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ringtrain.observe.meter import StepRecord

__all__ = ["TraceRecorder", "part_path", "merge", "wait_and_merge", "write_json_atomic", "write_trace",
           "horovod_events", "live_writer", "MERGE_WAIT_S", "HOROVOD_PID"]

#: Seconds rank 0 waits at exit for the other ranks' parts before merging what exists.
MERGE_WAIT_S = 5.0
#: Spans recorded per rank before the recorder stops (about 100 bytes each in memory).
MAX_SPANS = 500_000
# Tensor names listed per exchange span; a bucket of a large model holds hundreds.
_MAX_NAMES = 32

#: The process that holds a Horovod timeline's events (ranks are 0..size-1).
HOROVOD_PID = 1_000_000

_TID_STEPS = 1
_TID_COPIES = 2
_TID_FIRST_BUCKET = 10


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write ``doc`` as JSON through a temporary file and a rename (readers never see half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)


def _read_trace(path: Path) -> Any:
    """A trace file as JSON, or None. Horovod's own writer leaves its array open while
    the job runs (or when it was killed), so a missing ``]`` is tolerated as it is by
    chrome://tracing."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        try:
            return json.loads(text.rstrip().rstrip(",") + "]")
        except ValueError:
            return None


def horovod_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of the Horovod timeline at ``path``, on process :data:`HOROVOD_PID` with
    wall-clock times as ringtrain's own spans; ``[]`` when the file is not one.

    A Horovod timeline (ringtrain's ``hvd.start_timeline`` or Horovod's array form) counts
    its ``ts`` from ``start_time_since_epoch_in_micros``; ringtrain's spans are wall-clock
    microseconds, so the times are shifted by it and both line up.
    """
    doc = _read_trace(Path(path))
    if isinstance(doc, dict):
        events, meta = doc.get("traceEvents"), doc.get("metadata")
        epoch = meta.get("start_time_since_epoch_in_micros") if isinstance(meta, dict) else None
    elif isinstance(doc, list):  # Horovod's writer: the epoch is in its first event's args
        events, epoch = doc, None
        for e in doc[:1]:
            args = e.get("args") if isinstance(e, dict) else None
            if isinstance(args, dict):
                epoch = args.get("start_time_since_epoch_in_micros")
    else:
        return []
    if not isinstance(events, list) or not isinstance(epoch, (int, float)):
        return []  # ringtrain's own trace, or not a trace
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": HOROVOD_PID, "tid": 0,
         "args": {"name": "Horovod timeline"}},
        {"name": "process_sort_index", "ph": "M", "pid": HOROVOD_PID, "tid": 0,
         "args": {"sort_index": -1}},
    ]
    for e in events:
        if not isinstance(e, dict) or e.get("name") in ("process_name", "process_sort_index"):
            continue
        moved = dict(e, pid=HOROVOD_PID)
        # Horovod's own writer models each tensor as a process: keep them apart as threads.
        moved.setdefault("tid", e.get("pid", 0))
        ts, dur = e.get("ts"), e.get("dur")
        if isinstance(ts, (int, float)):
            # Whole microseconds, rounded before the (16-digit) epoch is added: a span
            # that ends where the next begins still does after the shift.
            moved["ts"] = round(ts) + int(epoch)
            if isinstance(dur, (int, float)):
                moved["dur"] = max(0, round(ts + dur) - round(ts))
        out.append(moved)
    return out


#: Horovod timelines this process is writing as it goes, by path: the function that ends
#: each (see :func:`live_writer`).
_live: dict[Path, Callable[[], object]] = {}


def live_writer(path: str | Path, finish: Callable[[], object]) -> Callable[[], None]:
    """Register a Horovod timeline being written to ``path`` (rank 0's, which appends each
    event); returns the function that unregisters it. :func:`write_trace` to the same
    path ends it first with ``finish()``: the file is then replaced by the merged one, and
    events appended to the replaced file afterwards would be lost without a word."""
    key = Path(path).resolve()
    _live[key] = finish

    def unregister() -> None:
        if _live.get(key) is finish:
            del _live[key]
    return unregister


def write_trace(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` (a ringtrain trace) to ``path``, keeping the events of a Horovod
    timeline already there (see :func:`horovod_events`); one this process is still
    writing there is ended first (ringtrain's trace is written at exit)."""
    finish = _live.pop(Path(path).resolve(), None)
    if finish is not None:
        finish()
    kept = horovod_events(path)
    if kept:
        doc = dict(doc, traceEvents=[*doc["traceEvents"], *kept])
    write_json_atomic(path, doc)


def part_path(path: str | Path, rank: int, size: int) -> Path:
    """Where rank ``rank`` of ``size`` writes its trace."""
    p = Path(path)
    if size == 1:
        return p
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


class TraceRecorder:
    """Collects one rank's spans and writes them as a trace.

    ``perf0``/``wall0`` anchor ``time.perf_counter()`` (the event clock) to wall time.
    """

    def __init__(self, rank: int, perf0: float | None = None, wall0: float | None = None,
                 max_spans: int = MAX_SPANS) -> None:
        self.rank = rank
        self._perf0 = time.perf_counter() if perf0 is None else perf0
        self._wall0 = time.time() if wall0 is None else wall0
        self._max = max_spans
        # (tid, name, category, t_start, t_end, args); formatted only when written.
        self._spans: list[tuple[int, str, str, float, float, Mapping[str, Any] | None]] = []
        self._bucket_tids: dict[str, int] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._spans)

    def _put(self, tid: int, name: str, cat: str, a: float, b: float,
             args: Mapping[str, Any] | None) -> None:
        if len(self._spans) >= self._max:
            self.dropped += 1
            return
        self._spans.append((tid, name, cat, a, b, args))

    def step(self, record: StepRecord, segments: Sequence[tuple[str, float, float]]) -> None:
        """A step span and its phases nested inside it."""
        args: dict[str, Any] = {"step_ms": round(record.step * 1e3, 3)}
        if record.samples is not None:
            args["samples"] = record.samples
        self._put(_TID_STEPS, f"step {record.index}", "step", record.start, record.end, args)
        for kind, a, b in segments:
            self._put(_TID_STEPS, kind, "phase", a, b, None)

    def retract_steps(self, since: float) -> None:
        """Drop the step spans that start at or after ``since`` (per-batch steps that the
        first optimizer update absorbed); their phases stay, nested in the update's span."""
        self._spans = [s for s in self._spans
                       if not (s[0] == _TID_STEPS and s[2] == "step" and s[3] >= since)]

    def span(self, kind: str, t_start: float, t_end: float, info: Mapping[str, Any]) -> None:
        """An event that is not part of the step split: an exchange or an overlapped copy.

        ``info`` is kept as it is and formatted only when the trace is written: this runs
        once per bucket per step, inside the training step.
        """
        if kind == "exchange":
            bucket = str(info.get("name", "exchange"))
            tid = self._bucket_tids.get(bucket)
            if tid is None:
                tid = self._bucket_tids[bucket] = _TID_FIRST_BUCKET + len(self._bucket_tids)
            self._put(tid, bucket, "exchange", t_start, t_end, info)
        elif kind == "h2d_copy":
            self._put(_TID_COPIES, "h2d_copy", "copy", t_start, t_end, info)

    @staticmethod
    def _args(cat: str, raw: Mapping[str, Any]) -> dict[str, Any]:
        if cat == "exchange":
            names = [str(n) for n in raw.get("tensors", ())]
            shown = names[:_MAX_NAMES]
            if len(names) > _MAX_NAMES:
                shown.append(f"(+{len(names) - _MAX_NAMES} more)")
            return {"bytes": int(raw.get("bytes", 0)), "tensors": shown}
        if cat == "copy":
            return {k: v for k, v in raw.items() if isinstance(v, (int, float, str, bool))}
        return dict(raw)

    def _us(self, t: float) -> int:
        # Whole microseconds: integer arithmetic keeps nested spans nested after rounding.
        return int(round((t - self._perf0 + self._wall0) * 1e6))

    def to_events(self) -> list[dict[str, Any]]:
        """The trace events: metadata naming the process and threads, then the spans."""
        pid = self.rank
        threads = {_TID_STEPS: "steps", _TID_COPIES: "copies"}
        threads.update({tid: f"exchange {name}" for name, tid in self._bucket_tids.items()})
        used = {tid for tid, *_ in self._spans}
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": f"rank {pid}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
             "args": {"sort_index": pid}},
        ]
        for tid in sorted(used | {_TID_STEPS}):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": threads.get(tid, str(tid))}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
        for tid, name, cat, a, b, raw in self._spans:
            ts = self._us(a)
            event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": ts,
                                     "dur": max(0, self._us(b) - ts), "pid": pid, "tid": tid}
            args = self._args(cat, raw) if raw else None
            if args:
                event["args"] = args
            out.append(event)
        return out

    def document(self, size: int = 1) -> dict[str, Any]:
        return {
            "traceEvents": self.to_events(),
            "displayTimeUnit": "ms",
            "otherData": {"producer": "ringtrain", "rank": self.rank, "size": size,
                          "dropped_spans": self.dropped},
        }

    def write(self, path: str | Path, size: int = 1) -> Path:
        """Write this rank's trace to its part of ``path``; returns the file written."""
        target = part_path(path, self.rank, size)
        if target == Path(path):  # one rank: its part is the trace the user opens
            write_trace(target, self.document(size))
        else:
            write_json_atomic(target, self.document(size))
        return target


def merge(parts: Iterable[str | Path], out: str | Path) -> Path:
    """Merge per-rank traces into one file; parts that are missing or unreadable are
    skipped, and a Horovod timeline at ``out`` is kept (see :func:`write_trace`)."""
    events: list[dict[str, Any]] = []
    ranks: list[int] = []
    for part in parts:
        try:
            doc = json.loads(Path(part).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        events.extend(doc.get("traceEvents", []))
        rank = doc.get("otherData", {}).get("rank")
        if isinstance(rank, int):
            ranks.append(rank)
    target = Path(out)
    write_trace(target, {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "ringtrain", "ranks": sorted(ranks)},
    })
    return target


def wait_and_merge(path: str | Path, size: int, wait_s: float = MERGE_WAIT_S) -> list[int]:
    """Rank 0's merge at exit: wait for the other parts (bounded), merge, return missing ranks."""
    parts = [part_path(path, r, size) for r in range(size)]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(p.exists() for p in parts):
        time.sleep(0.05)
    missing = [r for r, p in enumerate(parts) if not p.exists()]
    merge(parts, path)
    return missing
