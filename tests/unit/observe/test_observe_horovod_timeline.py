"""A Horovod timeline (``HOROVOD_TIMELINE`` / ``hvd.start_timeline``) is written as it
goes (valid JSON after every event, as Horovod's writer leaves it), ends at exit when the
script never stops it, and shares its file with ringtrain's own timeline
(``horovodrun --timeline-filename`` asks for both) instead of being replaced by it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ringtrain import events
from ringtrain.horovod import timeline as hvd_timeline
from ringtrain.horovod._coordinator.requests import Meta
from ringtrain.horovod._coordinator.trace import Trace
from ringtrain.observe import session
from ringtrain.observe.timeline import HOROVOD_PID, horovod_events, merge

sys.path.insert(0, str(Path(__file__).resolve().parent))
from observe_trace_check import check_trace  # noqa: E402


class _Engine:
    """What start_from_env needs of the coordinator: its trace."""

    def __init__(self) -> None:
        self.trace = Trace(0)


def _allreduce(trace: Trace, name: str) -> None:
    t = time.perf_counter()
    trace.ran(Meta(name, "allreduce", dtype="float32", shape=(3,)), t, t + 0.0013, t + 0.0031)


def _steps(n: int) -> None:
    t = time.perf_counter()
    for _ in range(n):
        t += 0.01
        events.emit("data_wait", t, t + 0.001, samples=4)
        events.emit("exchange", t + 0.002, t + 0.004, name="bucket0", bytes=12, tensors=["w"])
        events.emit("update", t + 0.004, t + 0.005)
        events.emit("step_end", t + 0.005, t + 0.005)


def _names(doc: dict) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            out.setdefault(e["pid"], set()).add(e["name"].split(" ")[0])
    return out


def test_a_timeline_never_stopped_is_on_disk_and_joins_the_step_trace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "timeline.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", str(path))
    eng = _Engine()
    hvd_timeline.start_from_env(eng)  # type: ignore[arg-type]
    # ringtrain's own timeline at the same file, flushed at exit before Horovod's.
    session.start(timeline=str(path), progress=False, warmup=0, gpu=False)
    _steps(3)
    _allreduce(eng.trace, "allreduce.grad")
    # On disk as it happens, a valid array (a killed job leaves it so): Horovod's form.
    live = json.loads(path.read_text())
    assert "start_time_since_epoch_in_micros" in live[0]["args"]
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} <= {e["name"] for e in live}
    session.flush()  # at exit: ends the Horovod file, then writes both into it
    assert eng.trace.stop() is None  # ended by the flush
    hvd_timeline.stop_at_exit()  # what atexit runs when the script never calls hvd.shutdown()
    doc = json.loads(path.read_text())
    assert check_trace(doc) == []
    names = _names(doc)
    assert names[HOROVOD_PID] == {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"}
    assert {"step", "data_wait", "update"} <= names[0]
    # The Horovod spans sit on the same wall clock as the steps (within the test's run).
    steps = [e["ts"] for e in doc["traceEvents"] if e.get("cat") == "step"]
    ours = [e["ts"] for e in doc["traceEvents"] if e["pid"] == HOROVOD_PID and e["ph"] == "X"]
    assert abs(min(ours) - max(steps)) < 60e6


def test_a_horovod_timeline_written_first_survives_ringtrains_merge(tmp_path: Path) -> None:
    """hvd.shutdown() wrote Horovod's file; rank 0's merge of the ranks' step traces at
    exit keeps it (it replaced it), and a later merge keeps it still (the doctor's)."""
    path = tmp_path / "t.json"
    trace = Trace(0)
    trace.start(path)
    _allreduce(trace, "allreduce.a")
    assert trace.stop() == path
    session.start(timeline=str(tmp_path / "steps.json"), progress=False, warmup=0, gpu=False)
    _steps(2)
    current = session.current()
    assert current is not None and current.trace is not None
    current.trace.write(tmp_path / "t.json", size=2)  # writes t.rank0.json
    merge([tmp_path / "t.rank0.json"], path)
    doc = json.loads(path.read_text())
    assert check_trace(doc) == []
    assert _names(doc)[HOROVOD_PID] == {"NEGOTIATE_ALLREDUCE", "ALLREDUCE"} and 0 in _names(doc)
    # A ringtrain trace at the path is replaced, not folded in: nothing stale carries over.
    merge([tmp_path / "t.rank0.json"], path)
    assert HOROVOD_PID not in _names(json.loads(path.read_text()))


def test_horovods_own_array_form_left_open_is_read(tmp_path: Path) -> None:
    """Horovod's writer: a JSON array, the epoch in the first event, no closing bracket
    while the job runs or after it was killed; a tensor per pid."""
    path = tmp_path / "hvd.json"
    path.write_text(
        '[\n{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros":'
        ' 1700000000000000}},\n{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "grad"}},\n'
        '{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 10, "pid": 1},'
        '{"ph": "X", "name": "1", "ts": 12, "pid": 1, "dur": 0},{"ph": "E", "ts": 20, "pid": 1},')
    got = horovod_events(path)
    b = next(e for e in got if e["ph"] == "B")
    assert b["pid"] == HOROVOD_PID and b["tid"] == 1 and b["ts"] == 1700000000000010
    assert [e["name"] for e in got if e["ph"] == "X"] == ["1"]
    assert horovod_events(tmp_path / "missing.json") == []
