"""Helpers for ringrun's process-level tests: test hosts, ringrun runs, orphan checks.

``test_hosts()`` builds (idempotently) the namespace hosts of ``setup_netns.sh``,
installing openssh-server / iproute2 with apt-get when running as root and they are
missing; it skips only when the kernel refuses network namespaces (the reason
printed), or when not root. Every process a test starts carries ``RINGTEST_MARKER`` in
its environment (remote workers get it through ``-x``), so a scan of /proc finds any
survivor; host agents are found as processes inside the namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
TRAIN = str(HERE / "train_tiny.py")
BIN = Path(sys.executable).parent
RINGRUN = str(BIN / "ringrun")
STATE = Path(os.environ.get("RT_NETNS_STATE", "/tmp/ringtrain-netns"))

__all__ = ["TestHosts", "test_hosts", "teardown_hosts", "ensure_packages", "new_marker", "env_for",
           "processes_with", "assert_no_orphans", "namespace_leftovers", "run_torch_only", "TRAIN", "RINGRUN",
           "BIN"]


@dataclass(frozen=True)
class TestHosts:
    addrs: tuple[str, ...]
    state: Path

    @property
    def ssh_flags(self) -> list[str]:
        """ringrun flags that reach the test hosts with the pinned host key."""
        return ["-i", str(self.state / "id_ed25519"),
                "--ssh-option", f"UserKnownHostsFile={self.state / 'known_hosts'}",
                "--ssh-option", "StrictHostKeyChecking=yes"]

    def namespace(self, addr: str) -> str:
        return f"rt-h{self.addrs.index(addr) + 1}"


def ensure_packages(commands: dict[str, str]) -> None:
    """Install the Debian packages of missing commands (root only), else skip naming them."""
    missing = {cmd: pkg for cmd, pkg in commands.items()
               if shutil.which(cmd) is None and not Path(f"/usr/sbin/{cmd}").exists()}
    if not missing:
        return
    pkgs = sorted(set(missing.values()))
    if os.geteuid() != 0:
        pytest.skip(f"needs {', '.join(missing)}: apt-get install -y {' '.join(pkgs)} (as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    res = subprocess.run(["apt-get", "install", "-y", "-qq", *pkgs], env=env, capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.fail(f"apt-get install {' '.join(pkgs)} failed: {res.stderr[-500:]}")


def test_hosts(n: int = 2) -> TestHosts:
    if os.geteuid() != 0:
        pytest.skip("multi-host tests need root to create network namespaces (CI runs as root)")
    ensure_packages({"sshd": "openssh-server", "ip": "iproute2", "ssh": "openssh-client"})
    res = subprocess.run(["bash", str(HERE / "setup_netns.sh"), str(n)], capture_output=True,
                         text=True, timeout=120)
    if res.returncode != 0:
        reason = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "no output"
        if "kernel refused" in reason:
            print(f"SKIP multi-host: {reason}", file=sys.stderr)
            pytest.skip(f"the kernel refuses network namespaces here: {reason}")
        pytest.fail(f"setup_netns.sh failed: {res.stderr[-1000:]}")
    return TestHosts(tuple(f"10.213.57.{10 + i}" for i in range(1, n + 1)), STATE)


test_hosts.__test__ = False  # type: ignore[attr-defined]  # not a test, despite the name
TestHosts.__test__ = False  # type: ignore[attr-defined]


def teardown_hosts() -> None:
    subprocess.run(["bash", str(HERE / "teardown_netns.sh")], capture_output=True, timeout=60)


def new_marker() -> str:
    return uuid.uuid4().hex


def env_for(marker: str, **extra: str) -> dict[str, str]:
    # Not the Slurm job the suite may itself run in: ringrun would take its nodes.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env["RINGTEST_MARKER"] = marker
    env.update(extra)
    return env


def run_torch_only(command: list[str], finished: Callable[[subprocess.CompletedProcess[str]], bool],
                   **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a job that has no ringtrain in it (a reference run, or a torch-only script
    under ringrun), isolated from an abort of torch's own at interpreter exit.

    torch 2.13 alone now and then aborts a rank as its interpreter exits, after the job
    has finished: a C++ thread of its process-group teardown is destroyed while still
    joinable ("terminate called without an active exception", SIGABRT; seen in CI under
    torchrun and under ringrun, in scripts with no ringtrain in them). When the run
    failed that way only and ``finished`` holds for its output (every rank reported
    done, its files are written), what the test compares is complete: the run is
    returned as a success, with a line saying what was ignored. Any other failure is
    returned as it is."""
    res = subprocess.run(command, capture_output=True, text=True, **kwargs)
    text = res.stdout + res.stderr
    torch_abort = res.returncode != 0 and ("terminate called" in text or "SIGABRT" in text)
    if torch_abort and finished(res):
        note = f"\n(test harness: exit status {res.returncode} from torch's abort at exit ignored)\n"
        return subprocess.CompletedProcess(res.args, 0, res.stdout, res.stderr + note)
    return res


def processes_with(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker`` (workers and their children)."""
    found = []
    needle = f"RINGTEST_MARKER={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                if "\nState:\tZ" not in (entry / "status").read_text():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def namespace_leftovers() -> list[str]:
    """Processes in the test namespaces other than their sshd listeners: agents, workers."""
    keep = set()
    for pidfile in STATE.glob("rt-h*.sshd.pid"):
        try:
            keep.add(int(pidfile.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    left = []
    for line in res.stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns.startswith("rt-h"):
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in map(int, pids):
            if pid in keep:
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
                    continue
            except OSError:
                continue
            if cmd.startswith("sshd: ["):
                continue  # a pre-auth child of an sshd still closing a connection
            left.append(f"{ns}:{pid}:{cmd.strip()}")
    return left


def assert_no_orphans(marker: str, within: float = 5.0, remote: bool = False) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not processes_with(marker) and (not remote or not namespace_leftovers()):
            return
        time.sleep(0.1)
    survivors = processes_with(marker)
    left = namespace_leftovers() if remote else []
    for pid in survivors:  # do not let one failure poison the next tests
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not survivors and not left, f"survivors: {survivors} {left}"
