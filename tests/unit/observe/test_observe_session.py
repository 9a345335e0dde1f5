"""The session: starts at the first event once armed, stops for good, and serves the doctor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ringtrain as rt  # noqa: F401
from ringtrain import events
from ringtrain.observe import session


def _steps(n: int, t: float = 0.0) -> float:
    for _ in range(n):
        events.emit("data_wait", t, t + 0.1, samples=4, workers=0, source="iterable")
        events.emit("update", t + 0.8, t + 1.0)
        events.emit("step_end", t + 1.0, t + 1.0)
        t += 1.0
    return t


def test_the_first_event_starts_metering_and_stop_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGTRAIN_PROGRESS", "0")
    assert session.current() is None
    session.arm()
    _steps(3)
    s = session.current()
    assert s is not None and s.meter.steps_seen == 3
    summary = session.summary()
    assert summary["steps"] == 2 and summary["shares"]["data_wait"] == pytest.approx(0.1)
    assert summary["rank"] == 0 and summary["size"] == 1
    json.dumps(summary)  # plain data
    final = session.stop()
    assert final["steps"] == 2
    _steps(2)
    assert session.current() is None and session.summary()["steps"] == 0


def test_doctor_request_from_the_environment(tmp_path: Path) -> None:
    assert session.doctor_request({}) is None
    req = session.doctor_request({"RINGTRAIN_DOCTOR": str(tmp_path), "RINGTRAIN_DOCTOR_STEPS": "7"})
    assert req == session.DoctorRequest(tmp_path, 7, session.DOCTOR_WARMUP)
    bad = session.doctor_request({"RINGTRAIN_DOCTOR": "d", "RINGTRAIN_DOCTOR_STEPS": "x",
                                  "RINGTRAIN_DOCTOR_WARMUP": "-1"})
    assert bad is not None and bad.steps == 0 and bad.warmup == session.DOCTOR_WARMUP


def test_doctor_mode_reports_and_leaves_after_the_measured_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGTRAIN_DOCTOR", str(tmp_path))
    monkeypatch.setenv("RINGTRAIN_DOCTOR_STEPS", "3")
    monkeypatch.setenv("RINGTRAIN_DOCTOR_WARMUP", "2")
    session.start(progress=False, gpu=False)
    _steps(4)  # 2 warm-up + 2 measured: not yet
    assert list(tmp_path.glob("meter-*.json")) == []
    events.check_stop()  # nothing asked yet
    _steps(1, t=10.0)  # the listener never raises into the publisher (opt.step's finally)
    with pytest.raises(SystemExit) as exit_info:
        events.check_stop()  # where the loop leaves: end of opt.step(), the next batch
    assert exit_info.value.code == 0
    (path,) = tmp_path.glob("meter-rank0-*.json")
    doc = json.loads(path.read_text())
    assert doc["complete"] is True and doc["summary"]["steps"] == 3
    assert doc["loader"] == {"workers": 0, "source": "iterable", "batches": None}
    assert len(doc["series"]["t"]) == 5 and doc["series"]["index"][0] == 0
    assert doc["cpu"]["per_rank"] > 0


def test_doctor_mode_without_a_step_limit_reports_at_flush(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGTRAIN_DOCTOR", str(tmp_path))
    monkeypatch.setenv("RINGTRAIN_DOCTOR_WARMUP", "0")
    session.start(progress=False, gpu=False)
    _steps(2)
    session.flush()
    (path,) = tmp_path.glob("meter-*.json")
    doc = json.loads(path.read_text())
    assert doc["complete"] is False and doc["summary"]["steps"] == 2
