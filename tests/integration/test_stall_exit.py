"""A detected stall ends the whole job promptly, with every strategy, and --max-restarts
restarts it (issue: with the native strategy the raising rank stayed alive for minutes
inside Gloo's process-group teardown, joining a thread blocked on the stopped peer)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hosts.harness import assert_no_orphans, env_for

SCRIPT = str(Path(__file__).parent / "scripts" / "stall_job.py")
RINGRUN = str(Path(sys.executable).parent / "ringrun")
STALL = 4


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy,how", [("native", "sleep"), ("native", "stop"), ("ring", "stop"),
                                          ("ps", "stop")])
def test_stall_error_ends_the_job_and_a_restart_finishes_it(strategy: str, how: str) -> None:
    marker = uuid.uuid4().hex
    env = env_for(marker)
    env["RINGTRAIN_STALL_TIMEOUT"] = str(STALL)
    t0 = time.monotonic()
    res = subprocess.run([RINGRUN, "-np", "2", "--no-progress", "python", SCRIPT, strategy, how],
                         capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0
    assert "StallError" in res.stdout + res.stderr and "rank 1" in res.stdout + res.stderr
    # start-up (a few seconds on a loaded machine) + the stall timeout + a 5 s bound to exit
    assert elapsed < 45 + STALL, elapsed
    assert_no_orphans(marker)
    again = subprocess.run([RINGRUN, "-np", "2", "--no-progress", "--max-restarts", "1", "python", SCRIPT,
                            strategy, how], capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert again.stdout.count("done") == 2
    assert_no_orphans(marker)
