"""Chaos: SIGKILL a random rank at a random step; the job restarts and ends bit-identical.

Each trial trains tests/hosts/train_tiny.py (CPU, fixed seeds, dropout, SGD with
momentum, a checkpoint every 20 steps) on 2 ranks with ``--max-restarts 2``. The
chosen rank stops at the chosen step of the first attempt and the test SIGKILLs it;
ringrun stops the other rank, restarts the job, the script resumes from the latest
checkpoint (model, optimizer, loader position, every rank's RNG), and the final
parameters must equal an uninterrupted run's exactly (``torch.equal``). The whole-host
kill is in test_ringrun_hosts.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from hosts.harness import RINGRUN, TRAIN, assert_no_orphans, env_for, new_marker

STEPS, EVERY, NP = 200, 20, 2
# Seeded so every run of the suite kills the same ranks at the same steps.
_rng = random.Random(20240611)
TRIALS = [(_rng.randrange(NP), _rng.randrange(1, STEPS)) for _ in range(3)]


def _args(d: Path) -> list[str]:
    return ["python", TRAIN, "--steps", str(STEPS), "--every", str(EVERY),
            "--checkpoint-dir", str(d / "ckpt"), "--out", str(d / "params.pt")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    d = tmp_path_factory.mktemp("uninterrupted")
    marker = new_marker()
    res = subprocess.run([RINGRUN, "-np", str(NP), *_args(d)], capture_output=True, text=True,
                         timeout=100, env=env_for(marker))
    assert res.returncode == 0, res.stderr[-2000:]
    assert_no_orphans(marker)
    return torch.load(d / "params.pt")


@pytest.mark.timeout(120)
# The first trial checks the promise in `make test`; the others hunt in `make test-system`.
@pytest.mark.parametrize("rank,step", [
    pytest.param(r, s, id=f"kill-rank{r}-at-step{s}", marks=[pytest.mark.system] if i else [])
    for i, (r, s) in enumerate(TRIALS)])
def test_job_survives_a_killed_rank_bit_identical(
        uninterrupted: dict[str, torch.Tensor], tmp_path: Path, rank: int, step: int) -> None:
    marker = new_marker()
    pause = tmp_path / "paused"
    env = env_for(marker, CHAOS_PAUSE_RANK=str(rank), CHAOS_PAUSE_STEP=str(step),
                  CHAOS_PAUSE_FILE=str(pause))
    proc = subprocess.Popen([RINGRUN, "-np", str(NP), "--max-restarts", "2", *_args(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 90
    while not pause.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pause.exists(), f"rank {rank} never reached step {step}"
    os.kill(int(pause.read_text()), signal.SIGKILL)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    assert f"rank {rank} (pid" in err and "was killed by SIGKILL" in err
    assert "restarting the job (restart 1 of 2)" in err
    redo_from = step // EVERY * EVERY  # at most the work since the last checkpoint is redone
    if redo_from:
        assert f"resumed at step {redo_from} (attempt 1)" in out
    else:
        assert "resumed at step" not in out
    final = torch.load(tmp_path / "params.pt")
    assert final.keys() == uninterrupted.keys()
    assert all(torch.equal(final[k], uninterrupted[k]) for k in final)
    assert_no_orphans(marker)

