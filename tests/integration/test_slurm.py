"""ringtrain on a real Slurm cluster: slurmctld and one slurmd per network-namespace node
(tests/hosts/slurm.py), Debian's slurm-wlm and munge, real srun and sbatch, no fakes.

- ``srun -N 2 -n 4`` runs a ringtrain script with the ranks, local ranks and cross
  ranks of Slurm's environment;
- ``ringrun`` in an ``sbatch`` script takes the allocation's nodes and ``-np`` (no -H);
- the sbatch script in docs/launch.md, run as it is, survives a killed rank
  (``--max-restarts``) and a killed node (``--requeue``) with the final parameters of
  an uninterrupted run, bit for bit.

They skip (with the reason) only where Slurm cannot be installed or run: not root, no
network namespaces.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hosts.harness import HERE, RINGRUN, TRAIN, assert_no_orphans, env_for, new_marker
from hosts.slurm import SlurmCluster, slurm_cluster, teardown_slurm

pytestmark = pytest.mark.system  # `make test-system`: see docs/testing.md

ROOT = HERE.parents[1]
PROBE = str(Path(__file__).parent / "scripts" / "slurm_probe.py")
DOCS = ROOT / "docs" / "launch.md"
PROBE_LINE = re.compile(r"rank=(\d)/4 local=(\d)/2 cross=(\d)/2 node=(\S+) launcher=(\w+) sum=10")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    started = time.monotonic()
    c = slurm_cluster()
    print(f"\n[slurm] cluster up in {time.monotonic() - started:.1f} s", file=sys.stderr)
    yield c
    teardown_slurm()


@pytest.fixture(autouse=True)
def _clean_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "cluster" not in request.fixturenames:
        return
    c: SlurmCluster = request.getfixturevalue("cluster")
    c.run(["scancel", "--user", "root"], timeout=20)  # nothing of one test runs into the next
    deadline = time.monotonic() + 20
    while c.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.leftovers() == [], "processes left on the nodes"


def _docs_script() -> str:
    text = DOCS.read_text()
    marker = "<!-- tests/integration/test_slurm.py runs this script as it is -->"
    block = text[text.index(marker):]
    return block.split("```bash\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The docs script's job (4 ranks, train.py = tests/hosts/train_tiny.py with its
    defaults) run on this host alone without faults: what every Slurm run must reproduce."""
    d = tmp_path_factory.mktemp("uninterrupted")
    marker = new_marker()
    res = subprocess.run([RINGRUN, "-np", "4", "--oversubscribe", "python", TRAIN, "--checkpoint-dir",
                          str(d / "ckpt"), "--out", str(d / "params.pt")],
                         capture_output=True, text=True, timeout=280, env=env_for(marker))
    assert res.returncode == 0, res.stderr[-2000:]
    assert_no_orphans(marker)
    return torch.load(d / "params.pt")


def _job_dir(tmp_path: Path) -> Path:
    """A submit directory with the docs' sbatch script and train.py (train_tiny.py)."""
    (tmp_path / "job.sh").write_text(_docs_script())
    shutil.copy(TRAIN, tmp_path / "train.py")
    return tmp_path


def _submit(cluster: SlurmCluster, workdir: Path, script: str, env: dict[str, str]) -> str:
    res = cluster.run(["sbatch", "--parsable", script], env=env, cwd=str(workdir), timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def _job(cluster: SlurmCluster, job: str) -> dict[str, str]:
    """scontrol's fields of a job ({} once it is forgotten)."""
    res = cluster.run(["scontrol", "-o", "show", "job", job], timeout=20)
    return dict(f.split("=", 1) for f in res.stdout.split() if "=" in f)


def _wait_state(cluster: SlurmCluster, job: str, states: set[str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = _job(cluster, job)
        if info.get("JobState") in states:
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job} not in {states} after {timeout:.0f}s: {info.get('JobState')} "
                         f"({info.get('Reason')})")


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(120)
def test_srun_gives_each_rank_its_place_from_slurms_environment(cluster: SlurmCluster) -> None:
    marker = new_marker()
    res = cluster.run(["srun", "-N", "2", "-n", "4", "python", PROBE], timeout=100,
                      env=cluster.env(env_for(marker)))
    assert res.returncode == 0, res.stderr[-3000:]
    found = sorted(PROBE_LINE.findall(res.stdout))
    # Slurm's block distribution: tasks 0-1 on the first node, 2-3 on the second.
    assert found == [("0", "0", "0", "rts-n1", "slurm"), ("1", "1", "0", "rts-n1", "slurm"),
                     ("2", "0", "1", "rts-n2", "slurm"), ("3", "1", "1", "rts-n2", "slurm")], res.stdout
    assert_no_orphans(marker)


@pytest.mark.timeout(120)
def test_ringrun_in_sbatch_takes_the_allocations_nodes(cluster: SlurmCluster, tmp_path: Path) -> None:
    marker = new_marker()
    (tmp_path / "probe.sh").write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n"
                                       f"#SBATCH --output=out.txt\nringrun python {PROBE}\n")
    # Not `sbatch --wait`: it waits 2, 8, then 32 s between polls here (seen in this
    # cluster's log: a job that ended at 13 s was reported at 42 s); scontrol every 0.5 s
    # sees the end at once.
    job = _submit(cluster, tmp_path, "probe.sh", cluster.env(env_for(marker)))
    info = _wait_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=100)
    out = (tmp_path / "out.txt").read_text()
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", out[-3000:] + str(info)
    found = sorted(PROBE_LINE.findall(out))
    assert found == [("0", "0", "0", "rts-n1", "ringrun"), ("1", "1", "0", "rts-n1", "ringrun"),
                     ("2", "0", "1", "rts-n2", "ringrun"), ("3", "1", "1", "rts-n2", "ringrun")], out
    assert_no_orphans(marker)


def _start_paused_job(cluster: SlurmCluster, workdir: Path, marker: str, step: int) -> tuple[str, Path]:
    """Submit the docs script with rank 2 (on the second node) pausing before ``step``."""
    pause = workdir / "paused"
    env = cluster.env(env_for(marker, CHAOS_PAUSE_RANK="2", CHAOS_PAUSE_STEP=str(step),
                              CHAOS_PAUSE_FILE=str(pause)))
    job = _submit(cluster, workdir, "job.sh", env)
    deadline = time.monotonic() + 150
    while not pause.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pause.exists(), f"rank 2 never reached step {step}: {_output(workdir, job)[-2000:]}"
    return job, pause


def _output(workdir: Path, job: str) -> str:
    path = workdir / f"ringtrain-{job}.out"
    return path.read_text() if path.exists() else ""


@pytest.mark.timeout(300)
def test_docs_script_restarts_a_killed_rank_in_the_allocation(
        cluster: SlurmCluster, uninterrupted: dict[str, torch.Tensor], tmp_path: Path) -> None:
    marker = new_marker()
    workdir = _job_dir(tmp_path)
    job, pause = _start_paused_job(cluster, workdir, marker, step=110)
    os.kill(int(pause.read_text()), signal.SIGKILL)  # rank 2 dies; its node lives on
    info = _wait_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=200)
    out = _output(workdir, job)
    assert info["JobState"] == "COMPLETED", out[-3000:]
    assert "was killed by SIGKILL" in out and "restarting the job (restart 1 of 2)" in out
    assert "resumed at step 100" in out
    assert _equal(torch.load(workdir / "params.pt"), uninterrupted)
    assert_no_orphans(marker)


@pytest.mark.timeout(420)
def test_docs_script_survives_a_killed_node_through_requeue(
        cluster: SlurmCluster, uninterrupted: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Every process of the second node (slurmd, step daemons, ranks) is SIGKILLed. The
    ranks left name the missing rank, slurmctld cancels the job for the node failure and
    requeues it; the node comes back, the job runs again and resumes from its last
    checkpoint, and ends exactly as the uninterrupted run."""
    marker = new_marker()
    workdir = _job_dir(tmp_path)
    job, _ = _start_paused_job(cluster, workdir, marker, step=130)
    killed = time.monotonic()
    cluster.kill_node(1)
    info = _wait_state(cluster, job, {"PENDING"}, timeout=120)  # requeued
    requeued = time.monotonic() - killed
    cluster.start_node(1)  # the node "reboots"
    cluster.wait_idle()
    if info.get("Reason") == "BeginTime":
        # A requeued job waits about two minutes before it is eligible again; start it now.
        cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=20)
    info = _wait_state(cluster, job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=200)
    out = _output(workdir, job)
    print(f"\n[slurm] node killed -> job requeued in {requeued:.0f} s; "
          f"finished {time.monotonic() - killed:.0f} s after the kill", file=sys.stderr)
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", out[-3000:]
    assert "DUE TO NODE FAILURE" in out
    assert "missing rank: rank 2" in out or "host rts-n2 was lost" in out, out[-3000:]
    assert "resumed at step 125" in out
    assert _equal(torch.load(workdir / "params.pt"), uninterrupted)
    assert_no_orphans(marker)


@pytest.mark.timeout(300)
def test_the_model_parallel_example_runs_under_srun_across_two_nodes(cluster: SlurmCluster) -> None:
    """examples/gpt_parallel.py with 2 pipeline stages, one per Slurm node: the same final
    loss as one process (issue: the same script runs under ringrun, torchrun, mpirun and srun)."""
    example = str(ROOT / "examples" / "gpt_parallel.py")
    args = ["--steps", "6", "--seed", "3", "--log-every", "3"]
    marker = new_marker()
    alone = subprocess.run([sys.executable, example, *args], capture_output=True, text=True, timeout=200,
                           env=env_for(marker), cwd=str(ROOT))
    assert alone.returncode == 0, alone.stderr[-2000:]
    res = cluster.run(["srun", "-N", "2", "-n", "2", "python", example, "--pipeline", "2", *args], timeout=250,
                      env=cluster.env(env_for(marker)), cwd=str(ROOT))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    want = float(re.findall(r"final loss (\S+)", alone.stdout)[0])
    got = float(re.findall(r"final loss (\S+)", res.stdout)[0])
    assert abs(got - want) <= 1e-5, (got, want)
    assert_no_orphans(marker)
