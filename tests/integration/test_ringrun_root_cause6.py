"""ringrun names the rank that failed first (torchrun's "root cause"), not a rank that
failed after it because its peer died, nor one ringrun stopped itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker

#: Rank 1 fails (3); rank 0 fails (5) a moment after rank 1 has exited, as a rank whose
#: peer died does: both exits fall between two of ringrun's looks (50 ms apart), where
#: the lower rank used to be named.
SECOND_FAILS_AFTER_FIRST = r"""
import os, sys, time
here = os.environ["T6_DIR"]
if os.environ["RINGTRAIN_RANK"] == "1":
    with open(os.path.join(here, "pid.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(here, "pid.tmp"), os.path.join(here, "pid"))
    sys.exit(3)
while not os.path.exists(os.path.join(here, "pid")):
    time.sleep(0.001)
pid = open(os.path.join(here, "pid")).read()
def exited():
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True
while not exited():
    time.sleep(0.0005)
time.sleep(0.020)
sys.exit(5)
"""

#: Rank 0 fails; rank 1, stopped by ringrun, exits 7 on SIGTERM: not the cause.
STOPPED_ONE_EXITS_NONZERO = r"""
import os, signal, sys, time
if os.environ["RINGTRAIN_RANK"] == "0":
    time.sleep(0.3)
    sys.exit(1)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
time.sleep(30)
"""


def _ringrun(program: str, marker: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RINGRUN, "-np", "2", "--oversubscribe", "python", "-c", program],
                          env=env_for(marker, **env), capture_output=True, text=True, timeout=30)


def _failure_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "stopping" in line and "other rank" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.timeout(40)
def test_the_rank_that_failed_first_is_named(tmp_path: Path) -> None:
    marker = new_marker()
    res = _ringrun(SECOND_FAILS_AFTER_FIRST, marker, T6_DIR=str(tmp_path))
    line = _failure_line(res.stderr)
    assert line.startswith("ringrun: rank 1 ") and "exited with code 3" in line, res.stderr
    assert res.returncode == 3  # the first failure's status, not the second's (5)
    assert_no_orphans(marker)


@pytest.mark.timeout(40)
def test_a_rank_ringrun_stopped_is_not_the_cause() -> None:
    marker = new_marker()
    res = _ringrun(STOPPED_ONE_EXITS_NONZERO, marker)
    line = _failure_line(res.stderr)
    assert line.startswith("ringrun: rank 0 ") and "exited with code 1" in line, res.stderr
    assert res.returncode == 1
    assert_no_orphans(marker)
