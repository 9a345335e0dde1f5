"""horovodrun's error for more ranks than slots names only flags horovodrun accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ringtrain.launch import horovodrun


@pytest.mark.parametrize("hosts", ["-H", "--hostfile"])
def test_too_many_ranks_for_the_slots_advises_no_ringrun_only_flag(
        hosts: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Horovod's launcher refuses -np 3 on two slots too; ringrun's advice
    # ("pass --oversubscribe") was refused by horovodrun as an unrecognized argument.
    script = tmp_path / "train.py"
    script.write_text("")
    listed = "localhost:2"
    if hosts == "--hostfile":
        (tmp_path / "hosts").write_text("localhost slots=2\n")
        listed = str(tmp_path / "hosts")
    assert horovodrun.main(["-np", "3", hosts, listed, sys.executable, str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "-np 3 is more than the 2 slots of localhost:2" in err
    assert "--oversubscribe" not in err
    assert "-H host:N" in err


def test_the_flag_ringrun_advises_is_one_horovodrun_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    # Why horovodrun's advice must not name it: its parser (Horovod's flags) lacks it.
    assert horovodrun.main(["--oversubscribe", "-np", "3", "-H", "localhost:2", "python", "x.py"]) == 2
    assert "unrecognized arguments: --oversubscribe" in capsys.readouterr().err


def test_max_np_above_a_fixed_host_lists_slots_is_a_cap_for_horovodrun() -> None:
    # Horovod's --max-np caps the job: on two listed slots, --max-np 4 runs on 2. ringrun
    # (without --like-horovod, which horovodrun passes) refuses it as a likely typo.
    from ringtrain.launch import cli

    argv = "-np 2 --min-np 1 --max-np 4 -H localhost:1,127.0.0.1:1".split()
    cfg = cli.build_config([*argv, "--like-horovod", "true"])
    assert cfg.elastic is not None and (cfg.elastic.min_np, cfg.elastic.max_np) == (1, 2)
    with pytest.raises(Exception, match="--max-np 4 is more than the 2 slots"):
        cli.build_config([*argv, "true"])
