"""Scripts written for torchrun, which call ``init_process_group()`` themselves, run
under ringrun unchanged and train to the same weights as under torchrun (issue: they
failed every time with EADDRINUSE because ringrun held rank 0's MASTER_PORT)."""

from __future__ import annotations

import ast
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from hosts.harness import assert_no_orphans, env_for, run_torch_only
from ringtest import free_port

SCRIPT = str(Path(__file__).parent / "scripts" / "ddp_torchrun_style.py")
BIN = Path(sys.executable).parent


def _both_done(res: subprocess.CompletedProcess[str]) -> bool:
    return res.stdout.count(" done") == 2


@pytest.fixture(scope="module")
def torchrun_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("torchrun") / "w.pt"
    marker = uuid.uuid4().hex
    # The reference is torch alone under torchrun (no ringtrain anywhere).
    res = run_torch_only([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          "2", SCRIPT, "gloo", str(out)], _both_done, timeout=100, env=env_for(marker))
    assert res.returncode == 0, res.stderr[-2000:]
    assert_no_orphans(marker)
    return torch.load(out)


@pytest.mark.timeout(220)
# ringrun's side is the same for the ways a script joins (its reservation of rank 0's
# port and torchrun's environment): `make test` runs a plain torchrun script and one that
# ringtrain joins; `make test-system` the other combinations (--master-port among them).
@pytest.mark.parametrize("mode,fixed_port", [
    ("gloo", False), ("rt-after", False),
    pytest.param("env", True, marks=pytest.mark.system),
    pytest.param("none", False, marks=pytest.mark.system),
    pytest.param("env", False, marks=pytest.mark.system),
    pytest.param("gloo", True, marks=pytest.mark.system),
])
def test_torchrun_script_under_ringrun_trains_as_under_torchrun(
        mode: str, fixed_port: bool, tmp_path: Path, torchrun_weights: dict[str, torch.Tensor]) -> None:
    out = tmp_path / "w.pt"
    marker = uuid.uuid4().hex
    port = ["--master-port", str(free_port())] if fixed_port else []
    command = [str(BIN / "ringrun"), "-np", "2", *port, "python", SCRIPT, mode, str(out)]
    if mode == "rt-after":  # ringtrain is in this script: it gets one run
        res = subprocess.run(command, capture_output=True, text=True, timeout=100, env=env_for(marker))
    else:  # these modes never import ringtrain
        res = run_torch_only(command, _both_done, timeout=100, env=env_for(marker))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "EADDRINUSE" not in res.stdout + res.stderr
    assert sorted(line for line in res.stdout.splitlines() if "done" in line) == [
        "[0] rank 0 of 2 done", "[1] rank 1 of 2 done"]
    got = torch.load(out)
    assert got.keys() == torchrun_weights.keys()
    for key, want in torchrun_weights.items():
        assert torch.equal(got[key], want), key
    assert_no_orphans(marker)


@pytest.mark.timeout(120)
def test_loader_and_lr_rule_see_a_process_group_the_script_started() -> None:
    # Without rt.init() they took the job for one process: every rank read the whole
    # dataset and the learning rate was not scaled.
    marker = uuid.uuid4().hex
    script = str(Path(__file__).parent / "scripts" / "loader_without_init.py")
    res = subprocess.run([str(BIN / "ringrun"), "-np", "2", "python", script],
                         capture_output=True, text=True, timeout=100, env=env_for(marker))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    shards = {}
    for line in res.stdout.splitlines():
        if " samples " in line:
            rank = int(line.split("rank ")[1].split()[0])
            shards[rank] = ast.literal_eval(line.split("samples ")[1].split(" lr")[0])
            assert line.endswith("lr 0.2"), line
    assert sorted(shards) == [0, 1] and len(shards[0]) == len(shards[1]) == 10
    assert sorted(shards[0] + shards[1]) == list(range(20))
    assert_no_orphans(marker)
