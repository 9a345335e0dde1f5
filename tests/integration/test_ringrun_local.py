"""ringrun on one host: env contract, output prefix, failure propagation, signals, no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hosts.harness import assert_no_orphans, env_for, processes_with

SCRIPT = str(Path(__file__).parent / "scripts" / "world_probe.py")
TREE = str(Path(__file__).parent / "scripts" / "spawn_tree.py")
BIN = Path(sys.executable).parent


def _ringrun(*args: str, marker: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ringrun"), *args], capture_output=True, text=True, timeout=timeout, env=env_for(marker)
    )


@pytest.mark.timeout(60)
def test_two_ranks_get_the_env_contract_and_prefixed_output() -> None:
    marker = uuid.uuid4().hex
    res = _ringrun("-np", "2", "python", SCRIPT, "ok", marker=marker)
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if "rank=" in line)
    assert lines == [
        "[0] rank=0 size=2 local=0/2 launcher=ringrun sum=3",
        "[1] rank=1 size=2 local=1/2 launcher=ringrun sum=3",
    ]
    assert_no_orphans(marker)


@pytest.mark.timeout(60)
def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    start = time.monotonic()
    res = _ringrun("-np", "3", "--oversubscribe", "--output-filename", str(tmp_path), "python", SCRIPT,
                   "fail-rank-1", marker=marker)
    assert res.returncode == 3
    assert "rank 1" in res.stderr and "exited with code 3" in res.stderr
    assert time.monotonic() - start < 30
    assert "rank=1" in (tmp_path / "rank.1.log").read_text()
    assert_no_orphans(marker)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_ringrun_ends_every_worker_within_5s(sig: signal.Signals, code: int) -> None:
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [str(BIN / "ringrun"), "-np", "2", "python", SCRIPT, "sleep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(marker),
    )
    assert proc.stdout is not None
    ready = 0
    deadline = time.monotonic() + 40
    while ready < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        ready += line.rstrip().endswith("ready")
    assert ready == 2
    sent = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=10) == code
    assert time.monotonic() - sent < 5.0
    assert_no_orphans(marker, within=1.0)


def _start_tree(marker: str) -> subprocess.Popen[str]:
    """ringrun -np 2 with each rank a grandchild (under bash) that starts a loader-like
    child and a setsid daemon (scripts/spawn_tree.py); returns once both are ready."""
    proc = subprocess.Popen(
        [str(BIN / "ringrun"), "-np", "2", "bash", "-c", f"python {TREE}; true"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(marker),
    )
    assert proc.stdout is not None
    ready = 0
    deadline = time.monotonic() + 40
    while ready < 2 and time.monotonic() < deadline:
        ready += proc.stdout.readline().rstrip().endswith("ready")
    assert ready == 2
    # Each rank: bash, python, its loader-like child, its daemon.
    assert len(processes_with(marker)) >= 8
    return proc


@pytest.mark.timeout(60)
def test_killed_ringrun_leaves_nothing_at_any_depth() -> None:
    """kill -9 of ringrun: the shells die with it (PR_SET_PDEATHSIG), and its watchdog
    ends the rest: the ranks under the shells, their children and their setsid daemons.
    Before: only the shells died; six processes per job kept running."""
    marker = uuid.uuid4().hex
    proc = _start_tree(marker)
    proc.kill()
    proc.wait(10)
    assert_no_orphans(marker, within=5.0)


@pytest.mark.timeout(60)
def test_sigterm_ends_processes_that_left_the_ranks_process_groups() -> None:
    marker = uuid.uuid4().hex
    proc = _start_tree(marker)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 143
    assert time.monotonic() - sent < 5.0
    assert_no_orphans(marker, within=1.0)


@pytest.mark.timeout(90)
def test_script_runs_under_torchrun() -> None:
    marker = uuid.uuid4().hex
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         SCRIPT, "ok"],
        capture_output=True, text=True, timeout=80, env=env_for(marker),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    # torchrun's ranks share one pipe, so their lines may interleave: match, don't split.
    assert sorted(re.findall(r"rank=\d size=\d local=\d/\d launcher=\w+ sum=\d", res.stdout)) == [
        "rank=0 size=2 local=0/2 launcher=torchrun sum=3",
        "rank=1 size=2 local=1/2 launcher=torchrun sum=3",
    ]
    assert_no_orphans(marker)


@pytest.mark.timeout(30)
def test_script_runs_alone_without_a_launcher() -> None:
    res = subprocess.run([sys.executable, SCRIPT, "ok"], capture_output=True, text=True, timeout=25)
    assert res.returncode == 0, res.stderr
    assert "rank=0 size=1 local=0/1 launcher=none sum=1" in res.stdout


@pytest.mark.timeout(90)
def test_sigterm_while_many_ranks_start_ends_everything_within_5s() -> None:
    """-np 1000 --oversubscribe: SIGTERM once a few ranks run. Before: ringrun went on
    starting all 1000 (42 s here) and only then stopped them."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([str(BIN / "ringrun"), "-np", "1000", "--oversubscribe", "sleep", "600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env_for(marker))
    try:
        deadline = time.monotonic() + 60
        while len(processes_with(marker)) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert took < 5.0, f"ringrun took {took:.1f}s to stop after SIGTERM"
    assert_no_orphans(marker, within=2.0)


@pytest.mark.timeout(30)
def test_more_ranks_than_cores_needs_oversubscribe() -> None:
    slots = len(os.sched_getaffinity(0))
    res = _ringrun("-np", str(slots + 1), "python", "-c", "pass", marker=uuid.uuid4().hex)
    assert res.returncode == 2
    assert res.stderr.startswith("ringrun: error: ") and res.stderr.count("\n") == 1
    assert f"more than the {slots} slots of this host ({slots} CPU core" in res.stderr
    assert "--oversubscribe" in res.stderr
