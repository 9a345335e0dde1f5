"""ringtrain plan: a bad --json is one line and leaves no other file behind (audit 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain.plan.cli import main


def test_json_under_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    # was a NotADirectoryError traceback after the plan was computed
    assert main(["--gpus", "8", "--json", str(blocker / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a folder" in err


def test_bad_json_path_writes_no_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "eff.png"
    # the plot was written first, then --json failed: exit 2 with a file left behind
    assert main(["--gpus", "8", "--plot", str(png), "--json", str(tmp_path / "no" / "plan.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not png.exists()


def test_a_folder_as_the_plot_is_refused_not_given_a_suffix(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "figs").mkdir()
    # was: wrote figs.png beside the folder
    assert main(["--gpus", "8", "--plot", str(tmp_path / "figs")]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert not (tmp_path / "figs.png").exists()
