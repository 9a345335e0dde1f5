"""What a torchrun user brings to ringrun: torchrun's agent variables inherited from a
torchrun worker are dropped (TORCHELASTIC_USE_AGENT_STORE made every rank's
init_process_group() wait, as a client, for an agent's store nobody serves), a bare
``train.py`` names the fix, and ``python -m ringtrain.launch`` is ringrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.launch import cli, horovodrun


@pytest.mark.parametrize("launcher", [cli.main, horovodrun.main])
def test_torchrun_agent_variables_do_not_reach_the_ranks(launcher: object,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for name in cli.TORCHRUN_AGENT_VARIABLES:
        monkeypatch.setenv(name, "True")
    assert launcher([]) == 2  # type: ignore[operator]  # no command: an error, after the drop
    assert not [n for n in cli.TORCHRUN_AGENT_VARIABLES if n in os.environ]


def test_a_bare_python_script_names_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["-np", "1", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "'train.py' is a Python script: write 'ringrun ... python train.py'" in err


def test_python_dash_m_ringtrain_launch_is_ringrun() -> None:
    out = subprocess.run([sys.executable, "-m", "ringtrain.launch", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "-np" in out.stdout, out.stderr
