"""ringtrain doctor's argument handling (no process started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.observe import doctor


@pytest.mark.parametrize("argv,message", [
    (["doctor"], "no command given"),
    (["doctor", "--"], "no command given"),
    (["doctor", "-np", "0", "--", "python", "x.py"], "-np must be >= 1"),
    (["doctor", "--steps", "-1", "--", "python", "x.py"], "must be >= 0"),
    (["doctor", "--", "no-such-command-xyz"], "not found"),
    (["doctor", "--bogus"], "see 'ringtrain doctor --help'"),
    # It was ignored: one process is never oversubscribed.
    (["doctor", "--oversubscribe", "--", "python", "x.py"], "--oversubscribe only applies with -np > 1"),
])
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == doctor.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_ringrun_is_used_for_more_than_one_rank() -> None:
    args = doctor.build_parser().parse_args(["-np", "3", "--", "python", "t.py"])
    command = doctor.build_command(args)
    assert command[1:5] == ["-m", "ringtrain.launch.cli", "-np", "3"]
    assert command[-2:] == ["python", "t.py"]
    many = doctor.build_command(doctor.build_parser().parse_args(["-np", "9", "--oversubscribe", "--", "python", "t.py"]))
    assert many[1:6] == ["-m", "ringtrain.launch.cli", "-np", "9", "--oversubscribe"]
    one = doctor.build_command(doctor.build_parser().parse_args(["python", "t.py", "--lr", "1"]))
    assert one == ["python", "t.py", "--lr", "1"]


def test_a_file_at_the_timeline_path_that_is_not_a_trace_is_kept_and_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Before, doctor deleted whatever was at --timeline (and NAME.rank*.EXT) before the run.
    precious = tmp_path / "notes.txt"
    precious.write_text("mine")
    sibling = tmp_path / "notes.rank0.txt"
    sibling.write_text("mine too")
    for target, named in ((precious, precious), (tmp_path, None)):  # a file, then a folder
        argv = ["doctor", "--out", str(tmp_path / "out"), "--timeline", str(target), "--", "true"]
        assert cli.main(argv) == doctor.EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        if named is not None:
            assert f"'{precious}' exists and is not a ringtrain timeline" in err
    assert precious.read_text() == "mine" and sibling.read_text() == "mine too"
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_out_that_is_a_file_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("x")
    assert cli.main(["doctor", "--out", str(tmp_path / "f"), "--", "true"]) == doctor.EXIT_USAGE
    err = capsys.readouterr().err
    assert "is a file; give a folder" in err and err.count("\n") == 1


def test_the_last_runs_trace_is_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = tmp_path / "t.json"
    old.write_text(json.dumps({"traceEvents": [], "otherData": {"producer": "ringtrain", "ranks": [0]}}))
    part = tmp_path / "t.rank1.json"
    part.write_text(json.dumps({"traceEvents": [], "otherData": {"producer": "ringtrain", "rank": 1}}))
    cli.main(["doctor", "-q", "--no-plot", "--out", str(tmp_path / "out"), "--timeline", str(old), "--", "true"])
    capsys.readouterr()
    assert not old.exists() and not part.exists()  # `true` writes no trace: none is shown
