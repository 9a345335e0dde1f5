"""ringrun across hosts: network-namespace hosts with their own sshd (tests/hosts/setup_netns.sh).

Each test host is a network namespace with its own address and sshd on this machine's
file system, so the repository and the venv have the same paths everywhere, as on a
cluster with a shared file system. Traffic stays on the rt-br0 bridge.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hosts.harness import (
    HERE,
    RINGRUN,
    TRAIN,
    TestHosts,
    assert_no_orphans,
    env_for,
    new_marker,
    teardown_hosts,
    test_hosts,
)

pytestmark = pytest.mark.system  # `make test-system`: see docs/testing.md

PROBE = str(HERE / "probe_worker.py")
TREE = str(Path(__file__).parent / "scripts" / "spawn_tree.py")
STEPS = ["--steps", "100", "--every", "20"]


@pytest.fixture(scope="module")
def hosts() -> Iterator[TestHosts]:
    yield test_hosts(2)
    teardown_hosts()


@pytest.fixture(scope="module")
def one_host_params(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The 4-rank job run on this host alone: what every multi-host run must reproduce."""
    d = tmp_path_factory.mktemp("one-host")
    marker = new_marker()
    res = subprocess.run([RINGRUN, "-np", "4", "--oversubscribe", "python", TRAIN, *STEPS,
                          "--checkpoint-dir", str(d / "ckpt"), "--out", str(d / "params.pt")],
                         capture_output=True, text=True, timeout=150, env=env_for(marker))
    assert res.returncode == 0, res.stderr[-2000:]
    assert_no_orphans(marker)
    return torch.load(d / "params.pt")


def _ringrun(hosts: TestHosts, *args: str, marker: str, timeout: float = 120
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RINGRUN, *hosts.ssh_flags, "-x", "RINGTEST_MARKER", *args],
                          capture_output=True, text=True, timeout=timeout, env=env_for(marker))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(180)
def test_four_ranks_on_two_hosts_train_exactly_like_one_host(
        hosts: TestHosts, one_host_params: dict[str, torch.Tensor], tmp_path: Path) -> None:
    marker = new_marker()
    h1, h2 = hosts.addrs
    res = _ringrun(hosts, "-np", "4", "-H", f"{h1}:2,{h2}:2", "--output-filename", str(tmp_path / "logs"),
                   "python", TRAIN, *STEPS, "--checkpoint-dir", str(tmp_path / "ckpt"),
                   "--out", str(tmp_path / "params.pt"), marker=marker)
    assert res.returncode == 0, res.stderr[-2000:]
    assert _equal(torch.load(tmp_path / "params.pt"), one_host_params)
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == [f"rank.{r}.log" for r in range(4)]
    assert "done 100 steps" in (tmp_path / "logs" / "rank.0.log").read_text()
    assert_no_orphans(marker, remote=True)


@pytest.mark.timeout(60)
def test_hostfile_places_ranks_and_passes_env_and_cwd(hosts: TestHosts, tmp_path: Path) -> None:
    marker = new_marker()
    h1, h2 = hosts.addrs
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# test cluster\n\n{h1} slots=2\n{h2} slots=2  # second\n")
    res = _ringrun(hosts, "-np", "3", "--hostfile", str(hostfile), "-x", "RT_TEST_X=forty two",
                   "python", PROBE, "report", marker=marker)
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if "rank=" in line)
    cwd = os.getcwd()
    # Horovod's cross size counts the hosts with that local rank (only h1 has local rank 1).
    assert lines == [
        f"[0] rank=0 ns=rt-h1 local=0/2 cross=0/2 master={h1} gloo_if=eth0 cwd={cwd} x=forty two "
        f"hvd=0/0/2@{h1}",
        f"[1] rank=1 ns=rt-h1 local=1/2 cross=0/2 master={h1} gloo_if=eth0 cwd={cwd} x=forty two "
        f"hvd=1/0/1@{h1}",
        f"[2] rank=2 ns=rt-h2 local=0/1 cross=1/2 master={h1} gloo_if=eth0 cwd={cwd} x=forty two "
        f"hvd=2/1/2@{h2}",
    ]
    assert_no_orphans(marker, remote=True)


@pytest.mark.timeout(60)
def test_local_rank0_with_a_remote_host(hosts: TestHosts) -> None:
    marker = new_marker()
    res = _ringrun(hosts, "-np", "2", "-H", f"localhost:1,{hosts.addrs[1]}:1", "python", PROBE,
                   "report", marker=marker)
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if "rank=" in line)
    # Rank 0 runs here; the remote host reaches it at the bridge address it sees us at.
    assert lines[0].startswith("[0] rank=0 ns=root local=0/1 cross=0/2 master=10.213.57.1 gloo_if=rt-br0")
    assert lines[1].startswith("[1] rank=1 ns=rt-h2 local=0/1 cross=1/2 master=10.213.57.1 gloo_if=eth0")
    assert_no_orphans(marker, remote=True)


@pytest.mark.timeout(60)
def test_start_timeout_names_the_host_that_did_not_come_up(hosts: TestHosts) -> None:
    marker = new_marker()
    silent = "10.213.57.99"  # on the test bridge, assigned to nobody: connects time out
    start = time.monotonic()
    res = _ringrun(hosts, "-np", "2", "-H", f"{hosts.addrs[0]}:1,{silent}:1", "--start-timeout", "2",
                   "python", PROBE, "report", marker=marker)
    assert res.returncode == 1
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert silent in res.stderr and hosts.addrs[0] not in res.stderr.split("(")[0]
    assert "did not come up within 2s" in res.stderr or "timed out" in res.stderr
    assert time.monotonic() - start < 15
    assert_no_orphans(marker, remote=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_remote_workers_within_5s(hosts: TestHosts, sig: signal.Signals, code: int) -> None:
    marker = new_marker()
    h1, h2 = hosts.addrs
    proc = subprocess.Popen([RINGRUN, *hosts.ssh_flags, "-x", "RINGTEST_MARKER", "-np", "4", "-H",
                             f"{h1}:2,{h2}:2", "python", PROBE, "sleep"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(marker))
    assert proc.stdout is not None
    ready = 0
    deadline = time.monotonic() + 40
    while ready < 4 and time.monotonic() < deadline:
        ready += proc.stdout.readline().rstrip().endswith("ready")
    assert ready == 4
    sent = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=10) == code
    assert time.monotonic() - sent < 5.0
    assert_no_orphans(marker, within=1.0, remote=True)


@pytest.mark.timeout(60)
def test_sigkilled_ringrun_leaves_nothing_on_the_hosts(hosts: TestHosts) -> None:
    """Each rank runs under a shell and starts a loader-like child and a setsid daemon
    (scripts/spawn_tree.py): the agents end all of it, by the job's mark."""
    marker = new_marker()
    h1, h2 = hosts.addrs
    proc = subprocess.Popen([RINGRUN, *hosts.ssh_flags, "-x", "RINGTEST_MARKER", "-np", "2", "-H",
                             f"{h1}:1,{h2}:1", "bash", "-c", f"python {TREE}; true"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env_for(marker))
    assert proc.stdout is not None
    ready = 0
    while ready < 2:
        ready += proc.stdout.readline().rstrip().endswith("ready")
    proc.kill()
    proc.wait(10)
    # ssh dies with ringrun (PDEATHSIG), the connection closes, each agent sees end of
    # input and stops its workers.
    assert_no_orphans(marker, within=5.0, remote=True)


@pytest.mark.timeout(120)
def test_multi_host_job_listens_only_on_the_chosen_addresses(hosts: TestHosts) -> None:
    """What a multi-host job exposes: rank 0's rendezvous port on the master address and
    Gloo's ports on the chosen interface's address; nothing on 0.0.0.0."""
    from hosts.sockets import listening_addresses

    marker = new_marker()
    h1, h2 = hosts.addrs
    proc = subprocess.Popen([RINGRUN, *hosts.ssh_flags, "-x", "RINGTEST_MARKER", "-np", "4", "-H",
                             f"{h1}:2,{h2}:2", "python", str(HERE / "listen_worker.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(marker))
    try:
        assert proc.stdout is not None
        ready = 0
        deadline = time.monotonic() + 90
        while ready < 4 and time.monotonic() < deadline:
            ready += proc.stdout.readline().rstrip().endswith("ready")
        assert ready == 4
        found = listening_addresses(marker)
        assert found, "the job listens nowhere?"
        assert {addr for addr, _ in found} <= {h1, h2}, found
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert_no_orphans(marker, remote=True)


@pytest.mark.timeout(180)
def test_killing_a_whole_host_restarts_the_job_with_the_same_result(
        hosts: TestHosts, one_host_params: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """Every process of host 2 (its sshd too) is SIGKILLed mid-training, the host comes
    back a second later, and the job finishes with exactly the uninterrupted result."""
    import random

    step = random.Random(5).randrange(21, 90)  # seeded: the same step on every run
    marker = new_marker()
    h1, h2 = hosts.addrs
    pause = tmp_path / "paused"
    env = env_for(marker, CHAOS_PAUSE_RANK="2", CHAOS_PAUSE_STEP=str(step), CHAOS_PAUSE_FILE=str(pause))
    proc = subprocess.Popen(
        [RINGRUN, *hosts.ssh_flags, "-x", "RINGTEST_MARKER", "-x", "CHAOS_PAUSE_RANK", "-x",
         "CHAOS_PAUSE_STEP", "-x", "CHAOS_PAUSE_FILE", "-np", "4", "-H", f"{h1}:2,{h2}:2",
         "--max-restarts", "2", "--start-timeout", "20", "python", TRAIN, *STEPS,
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "params.pt")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while not pause.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pause.exists(), "rank 2 never reached the chosen step"
    ns = hosts.namespace(h2)
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:  # the host dies: sshd, the agent, both workers
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(1.0)
    test_hosts(2)  # the host "reboots": its sshd comes back
    out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err[-3000:]
    assert f"host {h2} was lost" in err and "restart 1 of 2" in err
    assert f"resumed at step {step // 20 * 20}" in out
    assert _equal(torch.load(tmp_path / "params.pt"), one_host_params)
    assert_no_orphans(marker, remote=True)
