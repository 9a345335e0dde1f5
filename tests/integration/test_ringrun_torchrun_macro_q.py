"""One real ringrun job: torchrun's ``${local_rank}`` in the command's arguments becomes
each rank's local rank (as ``torchrun --no-python printf ... '${local_rank}'`` prints
0 and 1), and ``--output-filename``'s ``rank.N.log`` holds exactly the bytes the rank
wrote, a last piece without a newline too (as torchrun's ``--redirects`` files)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker


@pytest.mark.timeout(30)
def test_local_rank_is_replaced_and_the_logs_hold_the_bytes_as_written(tmp_path: Path) -> None:
    marker = new_marker()
    logs = tmp_path / "logs"
    res = subprocess.run([RINGRUN, "-np", "2", "--output-filename", str(logs), "--output-tee",
                          "printf", "%s|%s|%s", "${local_rank}", "--out=run${local_rank}.txt", "a$$b"],
                         capture_output=True, timeout=25, env=env_for(marker))
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    for rank in (0, 1):
        want = f"{rank}|--out=run{rank}.txt|a$b".encode()  # $$ -> $, as torchrun's Template
        assert (logs / f"rank.{rank}.log").read_bytes() == want
        assert f"[{rank}] ".encode() + want + b"\n" in res.stdout  # the terminal ends the line
    assert_no_orphans(marker)


@pytest.mark.timeout(30)
def test_a_resizable_jobs_ranks_get_their_local_rank_too() -> None:
    marker = new_marker()
    res = subprocess.run([RINGRUN, "--min-np", "2", "--max-np", "2", "-H", "localhost:2",
                          "sh", "-c", 'echo "macro=$0 env=$LOCAL_RANK"', "${local_rank}"],
                         capture_output=True, timeout=25, env=env_for(marker))
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    for rank in (0, 1):
        assert f"[{rank}] macro={rank} env={rank}".encode() in res.stdout
    assert_no_orphans(marker)
