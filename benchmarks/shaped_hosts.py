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
added with ``netem`` when the kernel has it (``CONFIG_NET_SCH_NETEM``), else by a delay
line in each host (``delay_line.py``: the netfilter queue holds every packet the host
receives for the delay; needs ``iptables``); with neither, :func:`build` warns and the
link has only its queueing delay. Either way a packet pays ``delay_ms`` once per
direction, a round trip twice.

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
import select
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Host", "ShapedHosts", "ShapedHostsError", "requirements", "build", "teardown", "launch",
           "rank_env", "probe_rate", "probe_rtt"]

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
    delay_ms: float  #: the one-way delay actually added (0 when neither way is available)
    qdisc: str  #: what shapes each direction, as tc was told
    #: The hosts' delay lines (no netem): closing their stdin ends them.
    delay_lines: tuple[subprocess.Popen[str], ...] = field(default=(), compare=False, repr=False)

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


def _iptables() -> str | None:
    for tool in ("iptables", "/usr/sbin/iptables"):
        if shutil.which(tool):
            return shutil.which(tool)
    return None


def _start_delay_lines(hosts: Sequence[Host], delay_ms: float) -> list[subprocess.Popen[str]]:
    """One delay line per host on what its eth0 receives; raises when one cannot start."""
    iptables = _iptables()
    if iptables is None:
        raise ShapedHostsError("iptables not found; apt-get install -y iptables")
    import delay_line

    script = str(Path(__file__).resolve().with_name("delay_line.py"))
    procs: list[subprocess.Popen[str]] = []
    try:
        for h in hosts:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", h.namespace, sys.executable, script, "--delay-ms",
                 f"{delay_ms:g}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True))
        for h, p in zip(hosts, procs, strict=True):
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], 20)
            line = p.stdout.readline().strip() if ready else ""
            if line != "ready":
                raise ShapedHostsError(f"the delay line of {h.namespace} did not start: "
                                       f"{line or 'no answer within 20 s'}")
            # Only now: a rule sending packets to a queue nobody listens on drops them.
            _run("ip", "netns", "exec", h.namespace, iptables, *delay_line.rule(0, "eth0"))
    except BaseException:
        _stop(procs)
        raise
    return procs


def _kill(procs: Sequence[subprocess.Popen[str]], wait: bool = True) -> None:
    """SIGKILL each live process's session (each was started in its own)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        if wait:
            p.wait()


def _stop(procs: Sequence[subprocess.Popen[str]]) -> None:
    _kill(procs)
    for p in procs:
        for stream in (p.stdin, p.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


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
        netem = delay_ms > 0 and _netem_available(hosts[0].namespace, "eth0")
        for h in hosts:
            _shape(["ip", "netns", "exec", h.namespace], "eth0", mbit, delay_ms if netem else 0)
            _shape([], h.bridge_port, mbit, delay_ms if netem else 0)  # what it receives
        qdisc = f"tbf rate {mbit:g}mbit burst {_BURST} latency {_LATENCY}, on both ends"
        added, lines = (delay_ms, []) if netem else (0.0, [])
        if netem:
            qdisc += f" + netem delay {delay_ms / 2:g}ms on each"
        elif delay_ms > 0:
            try:
                lines = _start_delay_lines(hosts, delay_ms)
                added = delay_ms
                qdisc += (f" + a {delay_ms:g} ms delay line on each host's incoming packets "
                          f"(netfilter queue; the kernel has no netem)")
            except ShapedHostsError as exc:
                warnings.warn(f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM) and {exc}: the "
                              f"links get no added delay, only {mbit:g} Mbit/s and their queueing "
                              f"delay", stacklevel=2)
    except BaseException:
        teardown(partial)
        raise
    return ShapedHosts(hosts, bridge, prefix, mbit, added, qdisc, tuple(lines))


def teardown(hosts: ShapedHosts) -> None:
    """End every process in the hosts' namespaces and remove them and the bridge."""
    _stop(hosts.delay_lines)
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
        outputs = _collect(procs, timeout_s, hosts)
    finally:
        _kill(procs)
    return outputs


def _collect(procs: list[subprocess.Popen[str]], timeout_s: float, hosts: ShapedHosts) -> list[str]:
    import threading

    outs = ["" for _ in procs]

    def read(i: int) -> None:
        stream = procs[i].stdout
        assert stream is not None
        outs[i] = stream.read()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        gone = [i for i, p in enumerate(hosts.delay_lines) if p.poll() is not None]
        if gone:  # its host now drops what it receives: say so instead of timing out
            _kill(procs, wait=False)
            out = hosts.delay_lines[gone[0]].stdout
            raise ShapedHostsError(f"the delay line of {hosts.hosts[gone[0]].namespace} exited "
                                   f"({hosts.delay_lines[gone[0]].returncode}): "
                                   f"{(out.read() if out else '').strip()[-300:]}")
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            _kill(procs, wait=False)
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


_RATE = """
import socket, sys, time
mode, addr, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "server":
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

_ECHO = """
import socket, sys, time
mode, addr, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if mode == "server":
    s.bind((addr, 29598)); print("ready", flush=True)
    for _ in range(count):
        d, a = s.recvfrom(64); s.sendto(d, a)
else:
    s.settimeout(5); out = []
    for i in range(count):
        t = time.perf_counter(); s.sendto(b"%d" % i, (addr, 29598)); s.recvfrom(64)
        out.append((time.perf_counter() - t) * 1e3); time.sleep(0.01)
    print(" ".join(f"{x:.3f}" for x in out), flush=True)
"""


def _probe(hosts: ShapedHosts, script: str, what: str, arg: int) -> tuple[str, str]:
    """``script``'s server in host 2, then, once it is ready, its client in host 1: their
    outputs (client's, server's)."""
    a, b = hosts.hosts[0], hosts.hosts[1]
    server = subprocess.Popen(["ip", "netns", "exec", b.namespace, sys.executable, "-c", script,
                               "server", b.addr, str(arg)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise ShapedHostsError(f"the {what} probe's server did not start")
        res = subprocess.run(["ip", "netns", "exec", a.namespace, sys.executable, "-c", script,
                              "client", b.addr, str(arg)], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise ShapedHostsError(f"the {what} probe failed: {res.stderr.strip()[-300:]}")
        out, _ = server.communicate(timeout=120)
        return res.stdout, out
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


def probe_rate(hosts: ShapedHosts, nbytes: int = 16 << 20) -> float:
    """Mbit/s of TCP payload from host 1 to host 2 (one stream): the shaper at work."""
    _, received = _probe(hosts, _RATE, "rate", nbytes)
    return float(received.strip().splitlines()[-1])


def probe_rtt(hosts: ShapedHosts, count: int = 20) -> list[float]:
    """Round trips from host 1 to host 2 in ms, sorted (small UDP datagrams): the delay at work."""
    sent, _ = _probe(hosts, _ECHO, "round-trip", count)
    return sorted(float(x) for x in sent.split())
