"""A real Slurm cluster on this machine for the Slurm tests: slurmctld and one slurmd per
network-namespace "node", from Debian's packages (slurm-wlm, munge).

    cluster = slurm_cluster()          # idempotent; skips with the reason where it cannot run
    cluster.run(["srun", "-N", "2", "-n", "4", "hostname"])
    teardown_slurm()

Layout (names and addresses differ from setup_netns.sh's rt-h*, 10.213.57.0/24 and the
container tests' rtc-h*, 10.213.58.0/24, so all can exist at once):

- nodes ``rts-n1``, ``rts-n2``: namespaces ``rts-h1``/``rts-h2`` at 10.213.59.11 and .12
  on the bridge ``rts-br0`` (10.213.59.1 in the root namespace); each runs a
  ``slurmd -N rts-nN``. The node names resolve inside the namespaces through
  ``/etc/netns/rts-hN/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts`` (so
  this machine's /etc/hosts is not touched), as a cluster's DNS would;
- ``slurmctld`` in the root namespace (this machine is the controller and the login
  node), its own ``munged`` with a throwaway key and socket, and ports 16817/16818 so a
  Slurm already installed here is not disturbed. Everything lives under the state
  directory (``RT_SLURM_STATE``, default /tmp/ringtrain-slurm).

The namespaces share this machine's file system, as cluster nodes share one: the
repository, the venv and a job's checkpoint directory have the same paths on every node.
Root only; the daemons run as root (``SlurmUser=root``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hosts.harness import ensure_packages

__all__ = ["SlurmCluster", "slurm_cluster", "teardown_slurm"]

STATE = Path(os.environ.get("RT_SLURM_STATE", "/tmp/ringtrain-slurm"))
NET = "10.213.59"
BRIDGE = "rts-br0"
NODES = ("rts-n1", "rts-n2")
NAMESPACES = ("rts-h1", "rts-h2")
ADDRS = (f"{NET}.11", f"{NET}.12")
CPUS_PER_NODE = 2
CTLD_PORT, SLURMD_PORT = 16817, 16818


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def _conf(state: Path) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={CPUS_PER_NODE} State=UNKNOWN"
                      for n, a in zip(NODES, ADDRS, strict=False))
    return f"""# Written by tests/hosts/slurm.py: a two-node test cluster on network namespaces.
ClusterName=ringtest
SlurmctldHost={host}({NET}.1)
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool/%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
# A node that stops answering is DOWN after 10 s (default 300); one that comes back is
# usable again at once; jobs that lost a node may be requeued.
SlurmdTimeout=10
ReturnToService=2
JobRequeue=1
MessageTimeout=5
KillWait=2
MinJobAge=30
InactiveLimit=0
SlurmdParameters=config_overrides
{nodes}
PartitionName=test Nodes={NODES[0][:-1]}[1-{len(NODES)}] Default=YES MaxTime=INFINITE State=UP
"""


@dataclass(frozen=True)
class SlurmCluster:
    state: Path
    nodes: tuple[str, ...] = NODES
    addrs: tuple[str, ...] = ADDRS
    namespaces: tuple[str, ...] = NAMESPACES

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    def env(self, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        env.update(extra)
        return env

    def run(self, argv: list[str], timeout: float = 60, env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=env or self.env(), cwd=cwd)

    def kill_node(self, index: int) -> None:
        """Power loss: SIGKILL every process of the node (slurmd, step daemons, tasks)."""
        pids = _ip("netns", "pids", self.namespaces[index], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def start_node(self, index: int) -> None:
        ns, node = self.namespaces[index], self.nodes[index]
        pidfile = self.state / f"slurmd.{node}.pid"
        if _alive(pidfile):
            return
        (self.state / "spool" / node).mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["ip", "netns", "exec", ns, "slurmd", "-f", str(self.conf), "-N", node],
                             capture_output=True, text=True, env=self.env(), timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"slurmd on {node}: {res.stderr.strip()[-500:]}")

    def node_states(self) -> dict[str, str]:
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=20)
        return dict(line.split() for line in res.stdout.splitlines() if line.strip())

    def wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(n, "").rstrip("*") in ("idle", "mixed", "allocated") for n in self.nodes):
                return
            for node, state in states.items():  # a node that was down comes back for the tests
                if state.startswith(("down", "drain")) and _alive(self.state / f"slurmd.{node}.pid"):
                    self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=20)
            time.sleep(0.5)
        raise RuntimeError(f"the nodes did not become idle: {states}")

    def leftovers(self) -> list[str]:
        """Processes in the node namespaces other than slurmd: step daemons, tasks."""
        left = []
        for ns in self.namespaces:
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                    if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
                        continue
                except OSError:
                    continue
                if cmd.startswith("slurmd "):
                    continue
                left.append(f"{ns}:{pid}:{cmd}")
        return left


def _alive(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text().split()[0]), 0)
        return True
    except (OSError, ValueError, IndexError):
        return False


def _namespaces() -> None:
    if _ip("link", "show", BRIDGE, check=False).returncode != 0:
        _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "replace", f"{NET}.1/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if nf.exists():  # bridged frames must not go through the host firewall
        try:
            nf.write_text("0")
        except OSError:
            pass
    listed = _ip("netns", "list", check=False).stdout.split()
    me = socket.gethostname()
    for ns, addr in zip(NAMESPACES, ADDRS, strict=False):
        # Each node's own host name resolves to its address, as on a cluster node (Gloo
        # binds what the host name resolves to when nothing names an interface).
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{a} {n}{' ' + me if a == addr else ''}\n" for a, n in zip(ADDRS, NODES, strict=False))
        if ns not in listed:
            _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        if _ip("-n", ns, "link", "show", "eth0", check=False).returncode != 0:
            _ip("link", "del", f"{ns}-br", check=False)
            _ip("link", "add", f"{ns}-br", "type", "veth", "peer", "name", f"{ns}-in")
            _ip("link", "set", f"{ns}-in", "netns", ns)
            _ip("-n", ns, "link", "set", f"{ns}-in", "name", "eth0")
            _ip("link", "set", f"{ns}-br", "master", BRIDGE)
        _ip("link", "set", f"{ns}-br", "up")
        _ip("-n", ns, "addr", "replace", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts)


def _munge(state: Path) -> None:
    d = state / "munge"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = d / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    if _alive(d / "munged.pid"):
        return
    res = subprocess.run(["munged", "--force", f"--socket={d / 'munge.socket'}", f"--key-file={key}",
                          f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                          f"--seed-file={d / 'munged.seed'}"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(f"munged: {res.stderr.strip()[-500:]}")


def slurm_cluster() -> SlurmCluster:
    """Build (idempotently) and start the test cluster; skip with the reason where Slurm
    cannot be installed or run here."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests need root (network namespaces, slurmd as root; CI runs as root)")
    ensure_packages({"slurmctld": "slurmctld", "slurmd": "slurmd", "srun": "slurm-client",
                     "munged": "munge", "ip": "iproute2"})
    state = STATE
    cluster = SlurmCluster(state)
    try:
        _namespaces()
    except RuntimeError as exc:
        pytest.skip(f"the kernel refuses network namespaces here: {exc}")
    for sub in ("ctld", "spool"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    cluster.conf.write_text(_conf(state))
    # slurmd 22.05 loads a cgroup plugin even when nothing uses cgroups (proctrack/pgid,
    # task/none here), and `ip netns exec` leaves no cgroup file system mounted: point the
    # v1 plugin at an empty directory instead of mounting one.
    (state / "cgroup").mkdir(exist_ok=True)
    (state / "cgroup.conf").write_text(f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={state / 'cgroup'}\n"
                                       "CgroupAutomount=no\n")
    try:
        _munge(state)
        if not _alive(state / "slurmctld.pid"):
            res = subprocess.run(["slurmctld", "-c", "-f", str(cluster.conf)], capture_output=True,
                                 text=True, env=cluster.env(), timeout=30)
            if res.returncode != 0:
                raise RuntimeError(f"slurmctld: {res.stderr.strip()[-500:]}")
        for i in range(len(NODES)):
            cluster.start_node(i)
        cluster.wait_idle()
    except RuntimeError as exc:
        logs = "; ".join(f"{p.name}: {p.read_text()[-300:]}" for p in sorted(state.glob("*.log")))
        pytest.fail(f"the Slurm test cluster did not start: {exc} ({logs})")
    return cluster


def teardown_slurm() -> None:
    """Stop the daemons, remove the namespaces, the bridge, /etc/netns/rts-h* and the state."""
    for pidfile in [*STATE.glob("slurmd.*.pid"), STATE / "slurmctld.pid", STATE / "munge" / "munged.pid"]:
        try:
            os.kill(int(pidfile.read_text().split()[0]), signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            pass
    time.sleep(0.5)
    for ns in NAMESPACES:
        for pid in _ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    try:
        Path("/etc/netns").rmdir()  # only when nothing else keeps files there
    except OSError:
        pass
    _ip("link", "del", BRIDGE, check=False)
    shutil.rmtree(STATE, ignore_errors=True)
