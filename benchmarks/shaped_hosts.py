"""Hosts with shaped links on one machine: network namespaces, each with a NIC-like limit.

    hosts = build(4, mbit=200, delay_ms=1.0)     # rtsh1..rtsh4, 10.213.70.11..14
    try:
        outputs = launch(hosts, [sys.executable, "worker.py"], timeout_s=600)
    finally:
        teardown(hosts)

Each host is a network namespace with one veth link into a bridge in the root namespace.
The link is shaped in both directions with ``tc``, as a full-duplex network card of
``mbit`` Mbit/s would be: a token bucket (``tbf``) on the host's own end (what it sends)
and one on the bridge's end (what it receives), so N-1 workers pushing to one parameter
server share that server's incoming rate, as on a real switch port. A fixed delay is
added with ``netem`` when the kernel has it (``CONFIG_NET_SCH_NETEM``); when it does not,
:func:`build` warns and the link has only its queueing delay.

Ranks are started directly in the namespaces with the torchrun-style environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...; ``GLOO_SOCKET_IFNAME=eth0``), one rank per
host: no sshd or launcher is involved, so a failure is the worker's own. Every process
is started in its own session and killed with it on timeout or failure.

Names and addresses (prefix ``rtsh``, 10.213.70.0/24 by default) differ from those of
``tests/hosts`` (``rt-h*``, 10.213.57.0/24), so both can exist side by side; tests pass
their own prefix and subnet so they do not collide with a running benchmark either.
Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Host", "ShapedHosts", "ShapedHostsError", "requirements", "build", "teardown", "launch",
           "rank_env", "probe_rate"]

PREFIX = "rtsh"
SUBNET = "10.213.70"
MASTER_PORT = 29511
# tbf's bucket: at least a few full-size frames (veth hands over GSO frames of up to
# 64 KB, which tbf would otherwise split or drop), and a queue of 20 ms at the rate:
# enough to keep TCP's window full without drops on a 100-400 Mbit/s link.
_BURST = "64kb"
_LATENCY = "20ms"
# Variables of a launcher this process may itself run under: the ranks must read only
# the torchrun-style environment given here.
_LAUNCHER_VARS = ("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "RINGTRAIN_RANK", "RINGTRAIN_SIZE",
                  "RINGTRAIN_LOCAL_", "RINGTRAIN_CROSS_", "RINGTRAIN_STORE_FD", "RINGTRAIN_ATTEMPT",
                  "RINGTRAIN_RUN_ID")


class ShapedHostsError(RuntimeError):
    """The shaped hosts cannot be built here (not root, no iproute2, kernel refused)."""


@dataclass(frozen=True)
class Host:
    namespace: str
    addr: str
    bridge_port: str  #: the veth end in the root namespace


@dataclass(frozen=True)
class ShapedHosts:
    hosts: tuple[Host, ...]
    bridge: str
    prefix: str
    mbit: float
    delay_ms: float  #: the delay actually added (0 when the kernel has no netem)
    qdisc: str  #: what shapes each direction, as tc was told

    @property
    def n(self) -> int:
        return len(self.hosts)


def requirements() -> str | None:
    """Why shaped hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "shaped hosts need root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} not found; apt-get install -y iproute2"
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise ShapedHostsError(f"{' '.join(cmd)}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def _netem_available(ns: str, dev: str) -> bool:
    res = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "9:",
               "netem", "delay", "1ms", check=False)
    if res.returncode == 0:
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
    return res.returncode == 0


def _shape(prefix_cmd: Sequence[str], dev: str, mbit: float, delay_ms: float) -> None:
    tc = [*prefix_cmd, "tc", "qdisc"]
    _run(*tc, "replace", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{mbit:g}mbit",
         "burst", _BURST, "latency", _LATENCY)
    if delay_ms > 0:
        # Half the delay on each end of the link: a round trip then pays delay_ms twice,
        # one way once, as a cable of that latency would.
        _run(*tc, "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
             f"{delay_ms / 2:g}ms")


def build(n: int, mbit: float, delay_ms: float = 1.0, prefix: str = PREFIX,
          subnet: str = SUBNET) -> ShapedHosts:
    """Create ``n`` hosts ``<prefix>1..n`` at ``<subnet>.11..``, links shaped to ``mbit``.

    Anything left from an earlier run with the same prefix is removed first; on failure
    everything built so far is removed again before the error is raised.
    """
    reason = requirements()
    if reason:
        raise ShapedHostsError(reason)
    if not 1 <= n <= 50:
        raise ShapedHostsError(f"between 1 and 50 hosts, got {n}")
    if not mbit > 0:
        raise ShapedHostsError(f"the link rate must be > 0 Mbit/s, got {mbit}")
    bridge = f"{prefix}-br0"
    hosts = tuple(Host(f"{prefix}{i}", f"{subnet}.{10 + i}", f"{prefix}{i}-br") for i in range(1, n + 1))
    partial = ShapedHosts(hosts, bridge, prefix, mbit, 0.0, "")
    teardown(partial)
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        if os.access("/proc/sys/net/bridge/bridge-nf-call-iptables", os.W_OK):
            # Bridged frames must not go through the host firewall (docker-style hosts drop them).
            with open("/proc/sys/net/bridge/bridge-nf-call-iptables", "w") as f:
                f.write("0")
        for h in hosts:
            _run("ip", "netns", "add", h.namespace)
            _run("ip", "-n", h.namespace, "link", "set", "lo", "up")
            _run("ip", "link", "add", h.bridge_port, "type", "veth", "peer", "name", f"{h.namespace}-in")
            _run("ip", "link", "set", f"{h.namespace}-in", "netns", h.namespace)
            _run("ip", "-n", h.namespace, "link", "set", f"{h.namespace}-in", "name", "eth0")
            _run("ip", "link", "set", h.bridge_port, "master", bridge)
            _run("ip", "link", "set", h.bridge_port, "up")
            _run("ip", "-n", h.namespace, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _run("ip", "-n", h.namespace, "link", "set", "eth0", "up")
        added = delay_ms if delay_ms > 0 and _netem_available(hosts[0].namespace, "eth0") else 0.0
        if delay_ms > 0 and added == 0:
            warnings.warn(f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): the links get "
                          f"no added delay, only {mbit:g} Mbit/s and their queueing delay",
                          stacklevel=2)
        for h in hosts:
            _shape(["ip", "netns", "exec", h.namespace], "eth0", mbit, added)  # what it sends
            _shape([], h.bridge_port, mbit, added)  # what it receives
    except BaseException:
        teardown(partial)
        raise
    qdisc = f"tbf rate {mbit:g}mbit burst {_BURST} latency {_LATENCY}" + (
        f" + netem delay {added / 2:g}ms, on both ends" if added else ", on both ends")
    return ShapedHosts(hosts, bridge, prefix, mbit, added, qdisc)


def teardown(hosts: ShapedHosts) -> None:
    """End every process in the hosts' namespaces and remove them and the bridge."""
    listed = _run("ip", "netns", "list", check=False).stdout.split()
    for h in hosts.hosts:
        if h.namespace in listed:
            pids = _run("ip", "netns", "pids", h.namespace, check=False).stdout.split()
            for pid in pids:  # only processes inside our own namespaces
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            _run("ip", "netns", "del", h.namespace, check=False)
        _run("ip", "link", "del", h.bridge_port, check=False)
    _run("ip", "link", "del", hosts.bridge, check=False)


def rank_env(hosts: ShapedHosts, rank: int, n: int, port: int = MASTER_PORT) -> dict[str, str]:
    """The torchrun-style environment of ``rank`` of an ``n``-rank job on the first ``n`` hosts."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(rank), "MASTER_ADDR": hosts.hosts[0].addr, "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
    }


def launch(hosts: ShapedHosts, argv: Sequence[str], n: int | None = None, timeout_s: float = 600,
           env: Mapping[str, str] | None = None) -> list[str]:
    """Run ``argv`` as ranks 0..n-1, rank r in host r+1; their stdout, by rank.

    The first rank to fail (or the deadline) ends all of them; the error carries the
    failing rank's last lines of output.
    """
    n = hosts.n if n is None else n
    if not 1 <= n <= hosts.n:
        raise ShapedHostsError(f"{n} ranks on {hosts.n} hosts")
    base = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARS)}
    procs = []
    try:
        for r in range(n):
            full = {**base, **(env or {}), **rank_env(hosts, r, n)}
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", hosts.hosts[r].namespace, *argv], env=full,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = _collect(procs, timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait()
    return outputs


def _collect(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[str]:
    import threading

    outs = ["" for _ in procs]

    def read(i: int) -> None:
        assert procs[i].stdout is not None
        outs[i] = procs[i].stdout.read()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            for t in readers:
                t.join(5)
            what = f"rank {failed[0]} exited with {procs[failed[0]].returncode}" if failed \
                else f"the job did not finish within {timeout_s:.0f} s"
            i = failed[0] if failed else 0
            tail = "\n".join(outs[i].strip().splitlines()[-15:])
            raise ShapedHostsError(f"{what}; rank {i}'s last output:\n{tail}")
        time.sleep(0.1)
    for t in readers:
        t.join(5)
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = "\n".join(outs[bad[0]].strip().splitlines()[-15:])
        raise ShapedHostsError(f"rank {bad[0]} exited with {procs[bad[0]].returncode}:\n{tail}")
    return outs


_PROBE = """
import socket, sys, time
mode, addr, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 29599)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); buf = bytearray(1 << 20); got = 0; t0 = None
    while got < nbytes:
        k = c.recv_into(buf)
        if not k: break
        t0 = t0 or time.perf_counter(); got += k
    print(got * 8 / (time.perf_counter() - t0) / 1e6, flush=True)
else:
    c = socket.create_connection((addr, 29599)); c.sendall(b"x" * nbytes); c.close()
"""


def probe_rate(hosts: ShapedHosts, nbytes: int = 16 << 20) -> float:
    """Mbit/s of TCP payload from host 1 to host 2 (one stream): the shaper at work."""
    a, b = hosts.hosts[0], hosts.hosts[1]
    recv = subprocess.Popen(["ip", "netns", "exec", b.namespace, sys.executable, "-c", _PROBE, "recv",
                             b.addr, str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            raise ShapedHostsError("the rate probe's receiver did not start")
        subprocess.run(["ip", "netns", "exec", a.namespace, sys.executable, "-c", _PROBE, "send", b.addr,
                        str(nbytes)], check=True, timeout=120)
        out, _ = recv.communicate(timeout=120)
        return float(out.strip().splitlines()[-1])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
