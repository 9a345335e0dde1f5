"""ringtrain doctor on a photo job that decodes whole images: it names DecodeCrop."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ringtrain.observe import doctor

SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent


# A bound for a hang, far above the 17-37 s measured beside one to three CPU hogs (it
# failed once, cause not captured, while the whole fast tier ran beside a 4-rank Horovod
# suite; passed 5 of 5 beside 1-3 hogs; the 120 s bound it had is the likely cause).
@pytest.mark.timeout(300)
def test_input_bound_photo_script_is_told_to_use_decodecrop(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("PIL")
    pytest.importorskip("sklearn")
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("RINGTRAIN_PROGRESS", "0")
    code = doctor.main(["--out", str(tmp_path / "doc"), "--no-plot", "-q", "--steps", "6",
                        "--warmup", "4", "--", "python",
                        str(SCRIPTS / "observe_photos_input_bound.py")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verdict: INPUT-BOUND" in out
    assert "transform=rt.data.DecodeCrop(224)" in out
    reports = doctor.load_reports(tmp_path / "doc")
    assert reports[0]["loader"]["images"] == "whole"
