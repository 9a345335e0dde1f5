"""ringtrain doctor end to end: verdicts on synthetic scripts, failures, scripts without ringtrain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.observe import doctor

SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def _path(monkeypatch: pytest.MonkeyPatch) -> None:
    # The scripts run as "python ...": it must be this interpreter.
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("RINGTRAIN_PROGRESS", "0")


def _doctor(tmp_path: Path, script: str, *flags: str) -> int:
    return doctor.main(["--out", str(tmp_path / "doc"), "--no-plot", "-q", *flags,
                        "--", "python", str(SCRIPTS / script)])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("script,np,verdict", [
    ("observe_input_bound.py", 1, "INPUT-BOUND"),
    ("observe_compute_bound.py", 1, "COMPUTE-BOUND"),
    ("observe_exchange_bound.py", 2, "EXCHANGE-BOUND"),
])
def test_verdict_on_synthetic_scripts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      script: str, np: int, verdict: str) -> None:
    # 12 steps: on a loaded machine one step's preemption is then a smaller share
    code = _doctor(tmp_path, script, "-np", str(np), "--steps", "12", "--warmup", "2")
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"verdict: {verdict}" in out, out
    assert f"{np} of {np} rank(s) reported, 12 steps measured" in out
    reports = doctor.load_reports(tmp_path / "doc")
    assert sorted(r["rank"] for r in reports) == list(range(np))
    assert all(r["complete"] and r["summary"]["steps"] == 12 for r in reports)
    # The doctor stopped the script after the measurement: 2 + 12 steps, not 10,000.
    assert all(r["summary"]["steps_seen"] == 14 for r in reports)
    timeline = json.loads((tmp_path / "doc" / "timeline.json").read_text())
    assert {e["pid"] for e in timeline["traceEvents"]} == set(range(np))
    if verdict == "INPUT-BOUND":
        assert "rt.data.Loader(dataset, num_workers=" in out
    if verdict == "EXCHANGE-BOUND":
        assert "Compression.fp16" in out and "16.0 MB" in out


@pytest.mark.timeout(60)
def test_failing_script_gives_its_exit_code_and_last_lines(tmp_path: Path) -> None:
    # Through the real command line, as a user runs it.
    proc = subprocess.run(
        [str(BIN / "ringtrain"), "doctor", "-q", "--out", str(tmp_path / "doc"), "--",
         "python", str(SCRIPTS / "observe_fails.py")],
        capture_output=True, text=True, timeout=50,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "the script failed with exit code 3; its last lines:" in proc.stdout
    assert "  | fatal: /data/imagenet does not exist" in proc.stdout


@pytest.mark.timeout(60)
def test_script_without_ringtrain_is_told_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = _doctor(tmp_path, "observe_no_ringtrain.py")
    out = capsys.readouterr().out
    assert code == doctor.EXIT_NO_STEPS
    assert "no ringtrain step was measured: does the script use rt.DistributedOptimizer" in out
