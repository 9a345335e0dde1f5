"""ringtrain doctor: bad --out and command are one line, exit 2, nothing run (audit 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.observe import doctor


def test_an_out_folder_that_cannot_be_created_is_one_line(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    # was a NotADirectoryError traceback from mkdir
    assert cli.main(["doctor", "--out", str(blocker / "sub"), "--", "python", "x.py"]) == doctor.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot create the folder" in err and "--out" in err


def test_a_directory_as_the_command_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli.main(["doctor", "--out", str(out), "--", str(tmp_path)]) == doctor.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err
    assert not out.exists()
