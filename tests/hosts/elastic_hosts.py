"""Namespace hosts for the resize tests: their own set (``rt-eN``, 10.213.58.0/24, bridge
``rt-ebr0``), built by setup_netns.sh beside the one other tests share, so no other
module's teardown takes them away; hosts that can be killed whole and brought back.

``kill_host`` SIGKILLs every process in a host's namespace, its sshd included: the
host's workers, its agent and its ssh server are gone at once, as when a machine
crashes (the kernel still closes their connections; the namespace and its address
stay, so the host can come back). ``revive_host`` starts its sshd again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hosts.harness import HERE, ensure_packages

__all__ = ["ElasticHosts", "build", "host_pids", "kill_host", "leftovers", "revive_host", "teardown"]

NS_ENV = {"RT_NETNS_PREFIX": "rt-e", "RT_NETNS_NET": "10.213.58", "RT_NETNS_BRIDGE": "rt-ebr0",
          "RT_NETNS_STATE": "/tmp/ringtrain-netns-elastic"}
STATE = Path(NS_ENV["RT_NETNS_STATE"])


@dataclass(frozen=True)
class ElasticHosts:
    addrs: tuple[str, ...]

    @property
    def ssh_flags(self) -> list[str]:
        return ["-i", str(STATE / "id_ed25519"),
                "--ssh-option", f"UserKnownHostsFile={STATE / 'known_hosts'}",
                "--ssh-option", "StrictHostKeyChecking=yes"]

    def namespace(self, addr: str) -> str:
        return f"{NS_ENV['RT_NETNS_PREFIX']}{self.addrs.index(addr) + 1}"


def _setup(n: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(HERE / "setup_netns.sh"), str(n)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **NS_ENV})


def build(n: int) -> ElasticHosts:
    if os.geteuid() != 0:
        pytest.skip("resize tests need root to create network namespaces (CI runs as root)")
    ensure_packages({"sshd": "openssh-server", "ip": "iproute2", "ssh": "openssh-client"})
    res = _setup(n)
    if res.returncode != 0:
        reason = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "no output"
        if "kernel refused" in reason:
            print(f"SKIP resize hosts: {reason}", file=sys.stderr)
            pytest.skip(f"the kernel refuses network namespaces here: {reason}")
        pytest.fail(f"setup_netns.sh failed: {res.stderr[-1000:]}")
    return ElasticHosts(tuple(f"{NS_ENV['RT_NETNS_NET']}.{10 + i}" for i in range(1, n + 1)))


def teardown() -> None:
    subprocess.run(["bash", str(HERE / "teardown_netns.sh")], capture_output=True, timeout=60,
                   env={**os.environ, **NS_ENV})


def host_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def kill_host(hosts: ElasticHosts, addr: str) -> int:
    """SIGKILL everything on host ``addr`` (workers, agent, sshd); how many processes."""
    ns = hosts.namespace(addr)
    killed = 0
    for _ in range(20):  # a process may fork while we kill
        pids = [p for p in host_pids(ns) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.05)
    return killed


def revive_host(hosts: ElasticHosts) -> None:
    """Start the sshd of every host that has none (setup_netns.sh is idempotent)."""
    res = _setup(len(hosts.addrs))
    assert res.returncode == 0, res.stderr[-1000:]


def leftovers(hosts: ElasticHosts) -> list[str]:
    """Processes in the hosts' namespaces other than their sshd listeners."""
    keep = set()
    for pidfile in STATE.glob("*.sshd.pid"):
        try:
            keep.add(int(pidfile.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    left = []
    for addr in hosts.addrs:
        ns = hosts.namespace(addr)
        for pid in host_pids(ns):
            if pid in keep:
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
                    continue
            except OSError:
                continue
            if not cmd.strip():
                continue  # exiting: its memory (and command line) already released, it runs nothing
            if cmd.startswith("sshd: ["):
                continue  # a pre-auth child of an sshd still closing a connection
            left.append(f"{ns}:{pid}:{cmd.strip()}")
    return left
