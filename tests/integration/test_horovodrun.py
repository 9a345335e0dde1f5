"""``horovodrun`` runs a Horovod-style script: Horovod's flags, Horovod's environment.

Real processes through the installed console script, as a user types it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hosts.harness import BIN, assert_no_orphans, env_for, new_marker

HOROVODRUN = str(BIN / "horovodrun")
SCRIPT = str(Path(__file__).parent / "scripts" / "horovod_style.py")


def _run(*args: str, marker: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HOROVODRUN, *args], capture_output=True, text=True, timeout=timeout,
                          env=env_for(marker))


@pytest.mark.timeout(120)
def test_horovod_style_script_runs_under_horovodrun(tmp_path: Path) -> None:
    """... with Horovod's --output-filename, which writes each rank's file and shows the
    output on the terminal as well (ringrun's alone writes only the files)."""
    marker = new_marker()
    timeline, logs = tmp_path / "timeline.json", tmp_path / "logs"
    res = _run("-np", "2", "--fusion-threshold-mb", "64", "--timeline-filename", str(timeline),
               "--output-filename", str(logs), "python", SCRIPT, marker=marker)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = sorted(line for line in res.stdout.splitlines() if "hvd rank=" in line)
    both = f"fusion=64.0/{64 << 20} timeline={timeline}/{timeline}"
    assert lines == [
        f"[0] hvd rank=0/2 local=0/2 cross=0/1 host=localhost {both} sum=1",
        f"[1] hvd rank=1/2 local=1/2 cross=0/1 host=localhost {both} sum=1",
    ]
    for rank in (0, 1):
        assert f"hvd rank={rank}/2 " in (logs / f"rank.{rank}" / "stdout").read_text()
    assert_no_orphans(marker)


@pytest.mark.timeout(120)
def test_the_same_script_runs_under_ringrun() -> None:
    """ringrun gives HOROVOD_* too (see launch/horovod_env.py for why)."""
    marker = new_marker()
    res = subprocess.run([str(BIN / "ringrun"), "-np", "2", "python", SCRIPT], capture_output=True,
                         text=True, timeout=100, env=env_for(marker))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert sum("hvd rank=" in line and "sum=1" in line for line in res.stdout.splitlines()) == 2
    assert_no_orphans(marker)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags,fragment", [
    (["--mpi"], "--mpi is not supported"),
    (["--jsrun"], "--jsrun is not supported"),
    (["--config-file", "/nonexistent/horovod.yaml"], "--config-file /nonexistent/horovod.yaml cannot be read"),
    (["--min-np", "3", "--max-np", "2"], "--max-np 2 is below --min-np 3"),
    (["--host-discovery-script", "discover.sh"], "is not an executable file"),
    (["--log-level", "LOUD"], "invalid choice: 'LOUD'"),
])
def test_unsupported_flags_are_one_line_and_exit_2(flags: list[str], fragment: str) -> None:
    marker = new_marker()
    res = _run("-np", "2", *flags, sys.executable, "-c", "pass", marker=marker, timeout=30)
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("horovodrun: error: "), res.stderr
    assert fragment in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""
    assert_no_orphans(marker)


@pytest.mark.timeout(120)
def test_check_build_tells_what_this_engine_has() -> None:
    import torch

    res = _run("--check-build", marker=new_marker())
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "[X] PyTorch" in out and "[ ] TensorFlow" in out and "[ ] MXNet" in out
    assert "[X] Gloo" in out and "[ ] MPI" in out and "[ ] DDL" in out and "[ ] CCL" in out
    nccl = torch.cuda.is_available() and torch.distributed.is_nccl_available()
    assert ("[X] NCCL" if nccl else "[ ] NCCL") in out


_LATE_EXIT = """
import time, torch, ringtrain.horovod as hvd
hvd.init()
hvd.allreduce(torch.ones(2), name="last")
if hvd.rank() == 0:
    time.sleep(9)  # still busy (evaluating, saving) while rank 1 is already at exit
print("done", hvd.rank(), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_rank_at_exit_waits_for_a_slower_one_without_hvd_shutdown(tmp_path: Path) -> None:
    """Horovod scripts rarely call hvd.shutdown(): the coordinator stops at exit, which is
    collective. A rank that gave up after a few seconds left its thread inside Gloo, and
    when the slower rank arrived that thread woke during finalization: SIGABRT (rc 134)."""
    script = tmp_path / "late_exit.py"
    script.write_text(_LATE_EXIT)
    marker = new_marker()
    res = _run("-np", "2", "python", str(script), marker=marker)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-2000:]
    assert "did not stop" not in out and "terminate called" not in out, out[-2000:]
    assert sorted(line for line in res.stdout.splitlines() if "done" in line) == ["[0] done 0", "[1] done 1"]
    assert_no_orphans(marker)


_RAISES = """
import ringtrain.horovod as hvd
hvd.init()
if hvd.rank() == 1:
    raise ValueError("bad batch on rank 1")
hvd.barrier()  # rank 0 waits for rank 1, which will never come
"""


@pytest.mark.timeout(60)
def test_a_rank_that_raises_ends_the_job_without_waiting_for_the_others(tmp_path: Path) -> None:
    """At exit the coordinator's shutdown is collective (above); a rank that dies on an
    exception must not wait for it: rank 0 sits in its barrier and never asks. It waited
    the stall timeout (600 s here), where Horovod's ranks fail at once."""
    script = tmp_path / "raises.py"
    script.write_text(_RAISES)
    marker = new_marker()
    res = subprocess.run([HOROVODRUN, "-np", "2", "python", str(script)], capture_output=True,
                         text=True, timeout=50, env=env_for(marker, RINGTRAIN_STALL_TIMEOUT="600"))
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-2000:]
    assert "ValueError: bad batch on rank 1" in out and "did not stop" not in out, out[-2000:]
    assert_no_orphans(marker)
