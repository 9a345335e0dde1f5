"""The timeline is a valid Chrome trace: JSON, well-nested spans, one pid per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from observe_trace_check import check_trace, load

from ringtrain.observe import session
from ringtrain.observe.meter import Meter
from ringtrain.observe.timeline import TraceRecorder, merge, part_path, wait_and_merge


def _record(rank: int, steps: int = 3, buckets: int = 2, t0: float = 100.0) -> TraceRecorder:
    """A recorder fed like the session feeds it: steps with overlapping bucket exchanges."""
    meter = Meter(warmup=0)
    rec = TraceRecorder(rank, perf0=t0, wall0=1_700_000_000.0)
    t = t0
    for _ in range(steps):
        meter.feed("data_wait", t, t + 0.003, {"samples": 8})
        for b in range(buckets):
            # Bucket b launches during backward and finishes after bucket b-1: the
            # exchanges overlap each other, so they need tracks of their own.
            info = {"name": f"bucket{b}[w{b}]", "bytes": 4096 * (b + 1),
                    "tensors": [f"layer{b}.weight", f"layer{b}.bias"]}
            a, z = t + 0.004 + 0.001 * b, t + 0.009 + 0.001 * b
            meter.feed("exchange", a, z, info)
            rec.span("exchange", a, z, info)
        meter.feed("exchange_wait", t + 0.008, t + 0.0105, {})
        meter.feed("update", t + 0.0105, t + 0.011, {})
        record = meter.feed("step_end", t + 0.011, t + 0.011, {})
        assert record is not None
        rec.step(record, meter.last_segments)
        rec.span("h2d_copy", t + 0.005, t + 0.006, {"overlapped": True, "bytes": 1})
        t += 0.011
    return rec


def test_one_rank_trace_is_valid_and_carries_the_phases(tmp_path: Path) -> None:
    path = _record(0).write(tmp_path / "trace.json", size=1)
    assert path == tmp_path / "trace.json"
    doc = load(path)
    assert check_trace(doc) == []
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    assert {"step 0", "step 2", "data_wait", "compute", "exchange_wait", "update",
            "h2d_copy", "bucket0[w0]", "bucket1[w1]"} <= names
    bucket = next(e for e in spans if e["name"] == "bucket1[w1]")
    assert bucket["args"] == {"bytes": 8192, "tensors": ["layer1.weight", "layer1.bias"]}
    assert bucket["dur"] == 5000  # microseconds
    assert {e["pid"] for e in doc["traceEvents"]} == {0}
    tids = {e["tid"] for e in spans if e["cat"] == "exchange"}
    assert len(tids) == 2  # one track per bucket


def test_phases_nest_inside_their_step() -> None:
    events = _record(0, steps=2).to_events()
    steps = [e for e in events if e.get("cat") == "step"]
    phases = [e for e in events if e.get("cat") == "phase"]
    for p in phases:
        owners = [s for s in steps if s["ts"] <= p["ts"] and p["ts"] + p["dur"] <= s["ts"] + s["dur"]]
        assert len(owners) >= 1, p
    # The phases of a step tile it: their durations add up to the step's.
    first = steps[0]
    inside = [p for p in phases if first["ts"] <= p["ts"] < first["ts"] + first["dur"]]
    assert sum(p["dur"] for p in inside) == first["dur"]


def test_parts_merge_into_one_trace_with_a_pid_per_rank(tmp_path: Path) -> None:
    target = tmp_path / "tl.json"
    parts = [_record(rank).write(target, size=3) for rank in range(3)]
    assert parts == [tmp_path / f"tl.rank{r}.json" for r in range(3)]
    for part in parts:  # each part opens on its own
        assert check_trace(load(part)) == []
    merge([*parts, tmp_path / "missing.json"], target)
    doc = load(target)
    assert check_trace(doc) == []
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1, 2}
    named = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert named == {0: "rank 0", 1: "rank 1", 2: "rank 2"}


def test_rank0_merge_waits_briefly_and_names_missing_ranks(tmp_path: Path) -> None:
    target = tmp_path / "tl.json"
    _record(0).write(target, size=2)
    missing = wait_and_merge(target, 2, wait_s=0.2)
    assert missing == [1]
    assert {e["pid"] for e in load(target)["traceEvents"]} == {0}


def test_part_path_keeps_the_single_rank_name() -> None:
    assert part_path("a/t.json", 0, 1) == Path("a/t.json")
    assert part_path("a/t.json", 5, 8) == Path("a/t.rank5.json")
    assert part_path("a/trace", 1, 2) == Path("a/trace.rank1.json")


def test_span_cap_drops_and_counts(tmp_path: Path) -> None:
    rec = TraceRecorder(0, max_spans=5)
    for i in range(8):
        rec.span("exchange", float(i), i + 0.5, {"name": "b", "bytes": 1})
    assert len(rec) == 5 and rec.dropped == 3
    doc = rec.document()
    assert doc["otherData"]["dropped_spans"] == 3 and check_trace(doc) == []


def test_long_tensor_lists_are_truncated() -> None:
    rec = TraceRecorder(0)
    rec.span("exchange", 0.0, 1.0, {"name": "b", "bytes": 1, "tensors": [f"p{i}" for i in range(100)]})
    span = next(e for e in rec.to_events() if e["ph"] == "X")
    assert len(span["args"]["tensors"]) == 33 and span["args"]["tensors"][-1] == "(+68 more)"


def test_session_writes_the_timeline_at_flush(tmp_path: Path) -> None:
    from ringtrain import events

    target = tmp_path / "run.json"
    session.start(timeline=str(target), progress=False, warmup=0, gpu=False)
    for k in range(3):
        t = 10.0 + k
        events.emit("data_wait", t, t + 0.1, samples=2)
        events.emit("exchange", t + 0.2, t + 0.5, name="bucket0[x]", bytes=8, tensors=["x"])
        events.emit("exchange_wait", t + 0.4, t + 0.5)
        events.emit("update", t + 0.5, t + 0.6)
        events.emit("step_end", t + 0.6, t + 0.6)
    assert not target.exists()
    session.flush()
    doc = json.loads(target.read_text())
    assert check_trace(doc) == []
    assert sum(1 for e in doc["traceEvents"] if e.get("cat") == "step") == 3
    assert sum(1 for e in doc["traceEvents"] if e.get("cat") == "exchange") == 3


@pytest.mark.parametrize("bad", [
    {"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 1},
                     {"name": "y", "ph": "X", "ts": 5, "dur": 10, "pid": 0, "tid": 1}]},
    {"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "pid": 0, "tid": 1}]},
])
def test_the_checker_itself_rejects_broken_traces(bad: dict) -> None:
    assert check_trace(bad) != []
