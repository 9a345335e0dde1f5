"""ringtrain doctor leaves nothing behind for a job that never started (one error line,
no ``runs/doctor``), and keeps what a job that ran wrote, failed or not."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ringtrain.observe import doctor


@pytest.fixture(autouse=True)
def _here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("RINGTRAIN_PROGRESS", "0")


def test_a_missing_script_is_one_line_and_makes_no_folder(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.main(["--no-plot", "--", "python", "nosuch.py"]) == doctor.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "'nosuch.py' does not exist" in captured.err, captured
    assert "running" not in captured.out  # nothing was started
    assert list(tmp_path.iterdir()) == []  # was: runs/doctor


@pytest.mark.timeout(30)
def test_a_job_ringrun_refuses_leaves_no_folder(tmp_path: Path) -> None:
    # More ranks than this host has slots: ringrun's one error line, exit 2, no rank ran.
    rc = doctor.main(["-np", "100000", "--out", "a/b/doc", "-q", "--no-plot", "--",
                      "python", "-c", "pass"])
    assert rc == 2
    assert list(tmp_path.iterdir()) == []  # was: a/b/doc


@pytest.mark.timeout(30)
def test_a_job_that_ran_and_failed_keeps_its_output(tmp_path: Path) -> None:
    wrote = "import os, sys; open(os.path.join(os.environ['RINGTRAIN_DOCTOR'], 'note.txt'), 'w'); sys.exit(4)"
    assert doctor.main(["--out", "runs/doctor", "-q", "--no-plot", "--", "python", "-c", wrote]) == 4
    assert (tmp_path / "runs" / "doctor" / "note.txt").is_file()


def test_a_folder_that_was_there_stays(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    assert doctor.main(["--out", "mine", "--", "python", "nosuch.py"]) == doctor.EXIT_USAGE
    assert (tmp_path / "mine").is_dir()
