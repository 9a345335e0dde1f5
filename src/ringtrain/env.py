"""Read the launch environment, in one place, into a frozen :class:`LaunchEnv`.

Every launcher tells a process who it is through environment variables, each in its
own dialect. This module is the only one in ringtrain that reads those variables;
everything else receives the resulting dataclass. Supported, in the order checked:

=========  =====================================================================
ringrun    RINGTRAIN_RANK, RINGTRAIN_SIZE, RINGTRAIN_LOCAL_RANK, RINGTRAIN_LOCAL_SIZE,
           RINGTRAIN_CROSS_RANK, RINGTRAIN_CROSS_SIZE, MASTER_ADDR, MASTER_PORT,
           RINGTRAIN_ATTEMPT, RINGTRAIN_RUN_ID, RINGTRAIN_STORE_FD
torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
           MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID
mpirun     OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (OpenMPI); MASTER_ADDR /
           MASTER_PORT if given, else loopback (one host) and a port derived from the job id
srun       SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES,
           SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (first node hosts the rendezvous)
none       a 1-process world, so the same script runs without a launcher
=========  =====================================================================

A script that starts its own processes (``mp.spawn``) and calls
``init_process_group(rank=rank, world_size=world_size)`` has no launcher variables:
``rt.init()`` then takes its place from that group (:func:`from_group`, launcher
``"script"``); without such a group, ``rt.init()`` refuses an environment that names a
rendezvous but no rank in such a process (:func:`rendezvous_without_rank`).

ringrun's variables with RANK / WORLD_SIZE of other values, or with a TORCHELASTIC_RUN_ID
other than RINGTRAIN_RUN_ID, are read as torchrun's: the process is a worker of a torchrun
(or other launcher) that ringrun started on each host.

TORCHELASTIC_USE_AGENT_STORE (torchrun's agent hosts the store, rank 0 is a client too) is
read in torchrun's dialect only: no other launcher has an agent store, and the variable
inherited from a torchrun worker that started ringrun, mpirun or srun would make rank 0
wait for a store that nobody serves.

Read in every dialect: GLOO_SOCKET_IFNAME (the interface Gloo binds) and
RINGTRAIN_JOB_SECRET (ringrun's per-job key for what ringtrain writes to the store, see
:mod:`ringtrain.signing`). A resizable job (``ringrun --min-np/--max-np``) also sets RINGTRAIN_WORLD_VERSION (which of the job's
successive worlds this is) and RINGTRAIN_ELASTIC_FILE (where ringrun writes the next one,
see :mod:`ringtrain.assignment`).

Parsing is a pure function of a mapping, so every dialect is unit-tested without
starting processes.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from ringtrain.errors import LaunchEnvError

__all__ = ["LaunchEnv", "expand_slurm_nodelist", "from_group", "parse_env", "rendezvous_without_rank"]

# Ports derived from a job id fall in this range: above the ephemeral ports Linux hands
# out by default (32768-60999) would collide with outgoing connections, so stay below.
_DERIVED_PORT_BASE = 20000
_DERIVED_PORT_SPAN = 10000


@dataclass(frozen=True)
class LaunchEnv:
    """Who this process is in the job, as its launcher described it."""

    #: "ringrun" | "torchrun" | "mpirun" | "slurm" | "none"; "script": no launcher, the
    #: script's own ``torch.distributed`` group gave rank and size (``mp.spawn`` and
    #: ``init_process_group(rank=, world_size=)``, see :func:`from_group`).
    launcher: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    master_addr: str
    master_port: int | None  # None: a 1-process world needs no rendezvous
    attempt: int = 0  # restart count; each attempt rendezvouses under its own key prefix
    run_id: str = ""
    store_fd: int | None = None  # rank 0's rendezvous port, reserved by ringrun (a bound socket)
    #: torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): rank 0 is a client too.
    agent_store: bool = False
    #: GLOO_SOCKET_IFNAME as given by the user or launcher (None: not set).
    gloo_interface: str | None = None
    #: ringrun's per-job secret (RINGTRAIN_JOB_SECRET) that seals ringtrain's store values.
    secret: str = field(default="", repr=False)
    #: A resizable job's world number (RINGTRAIN_WORLD_VERSION; 0: the first world).
    version: int = 0
    #: Where ringrun writes a resizable job's next world for this process
    #: (RINGTRAIN_ELASTIC_FILE; empty: the job has a fixed size).
    elastic_file: str = ""

    def __post_init__(self) -> None:
        where = f"(launcher {self.launcher})"
        if self.size < 1:
            raise LaunchEnvError(f"world size is {self.size} {where}; it must be >= 1")
        if not 0 <= self.rank < self.size:
            raise LaunchEnvError(
                f"rank {self.rank} is outside the world of size {self.size} {where}; "
                "check RANK / WORLD_SIZE (rank must be in [0, size))"
            )
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise LaunchEnvError(
                f"local rank {self.local_rank} is outside the local size {self.local_size} {where}; "
                "check LOCAL_RANK / LOCAL_WORLD_SIZE"
            )
        if self.local_size > self.size:
            raise LaunchEnvError(
                f"local size {self.local_size} exceeds world size {self.size} {where}"
            )
        if self.cross_size < 1 or not 0 <= self.cross_rank < self.cross_size:
            raise LaunchEnvError(
                f"cross rank {self.cross_rank} is outside the cross size {self.cross_size} {where}"
            )
        if self.size > 1 and self.master_port is None and self.launcher != "script":
            # (the script's group has a store already; a file:// one has no port)
            raise LaunchEnvError(
                f"a {self.size}-process world needs a rendezvous port {where}; set MASTER_PORT"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchEnvError(
                f"MASTER_PORT={self.master_port} is not a TCP port; use a value in 1..65535"
            )


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise LaunchEnvError(f"{name} is not set")
    try:
        return int(raw.strip())
    except ValueError:
        raise LaunchEnvError(f"{name}={raw!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    return _int(env, name) if env.get(name, "").strip() else default


def _require_together(env: Mapping[str, str], names: tuple[str, ...], dialect: str) -> None:
    present = [n for n in names if env.get(n, "").strip()]
    if present and len(present) != len(names):
        missing = [n for n in names if n not in present]
        raise LaunchEnvError(
            f"partial {dialect} environment: {', '.join(present)} set but "
            f"{', '.join(missing)} missing; set all of them or none"
        )


def _derived_port(job_id: str) -> int:
    # Every rank of one job sees the same job id, so they all derive the same port
    # without talking to each other; crc32 is stable across processes (hash() is not).
    return _DERIVED_PORT_BASE + zlib.crc32(job_id.encode()) % _DERIVED_PORT_SPAN


def _cross(rank: int, size: int, local_size: int, group_rank: int | None) -> tuple[int, int]:
    # Hosts run local_size processes each (ringrun fills hosts in order); the cross
    # communicator connects the processes with the same local rank across hosts.
    cross_size = max(1, -(-size // local_size))
    cross_rank = group_rank if group_rank is not None else rank // local_size
    return cross_rank, cross_size


def _from_ringrun(env: Mapping[str, str]) -> LaunchEnv:
    _require_together(
        env, ("RINGTRAIN_RANK", "RINGTRAIN_SIZE", "MASTER_ADDR", "MASTER_PORT"), "ringrun"
    )
    rank, size = _int(env, "RINGTRAIN_RANK"), _int(env, "RINGTRAIN_SIZE")
    local_size = _opt_int(env, "RINGTRAIN_LOCAL_SIZE", size) or size
    local_rank = _opt_int(env, "RINGTRAIN_LOCAL_RANK", rank % local_size) or 0
    cross_rank, cross_size = _cross(rank, size, local_size, _opt_int(env, "RINGTRAIN_CROSS_RANK", None))
    cross_size = _opt_int(env, "RINGTRAIN_CROSS_SIZE", cross_size) or cross_size
    return LaunchEnv(
        launcher="ringrun",
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT"),
        attempt=_opt_int(env, "RINGTRAIN_ATTEMPT", 0) or 0,
        run_id=env.get("RINGTRAIN_RUN_ID", ""),
        store_fd=_opt_int(env, "RINGTRAIN_STORE_FD", None),
    )


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    if "RANK" in env and "WORLD_SIZE" not in env:
        raise LaunchEnvError("RANK is set but WORLD_SIZE is not; set both (or neither)")
    if "WORLD_SIZE" in env and "RANK" not in env:
        raise LaunchEnvError("WORLD_SIZE is set but RANK is not; set both (or neither)")
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_size = _opt_int(env, "LOCAL_WORLD_SIZE", None)
    local_rank = _opt_int(env, "LOCAL_RANK", None)
    if local_size is None:
        # A bare RANK/WORLD_SIZE environment (no torchrun) is treated as one host.
        local_size = size
    if local_rank is None:
        local_rank = rank % local_size
    cross_rank, cross_size = _cross(rank, size, local_size, _opt_int(env, "GROUP_RANK", None))
    # torchrun names the node count itself; the ceiling of size / local size is wrong on
    # nodes with different process counts (nodes of 1 and 2: 3 on the first node, 2 on
    # the second, and rank 0 outside any real cross group).
    cross_size = _opt_int(env, "GROUP_WORLD_SIZE", None) or cross_size
    port = _opt_int(env, "MASTER_PORT", None)
    if size > 1 and port is None:
        raise LaunchEnvError(
            f"WORLD_SIZE={size} but MASTER_PORT is not set; set MASTER_ADDR and MASTER_PORT"
        )
    return LaunchEnv(
        launcher="torchrun",
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=port,
        attempt=_opt_int(env, "TORCHELASTIC_RESTART_COUNT", 0) or 0,
        run_id=env.get("TORCHELASTIC_RUN_ID", ""),
    )


def _from_openmpi(env: Mapping[str, str]) -> LaunchEnv:
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    local_rank = _opt_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0) or 0
    local_size = _opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", size) or size
    # Not OMPI_COMM_WORLD_NODE_RANK: that is the process's rank among all jobs' processes on
    # its node (a local rank), not the node's index; mpirun -np 2 on one host sets it to 1.
    cross_rank, cross_size = _cross(rank, size, local_size, None)
    addr = env.get("MASTER_ADDR")
    if addr is None:
        if local_size != size:
            raise LaunchEnvError(
                "mpirun across hosts needs a rendezvous address: pass "
                "'-x MASTER_ADDR=<first host> -x MASTER_PORT=<port>' to mpirun"
            )
        addr = "127.0.0.1"
    port = _opt_int(env, "MASTER_PORT", None)
    if port is None and size > 1:
        job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid", "")
        if not job:
            raise LaunchEnvError(
                "cannot derive a rendezvous port under mpirun; pass '-x MASTER_PORT=<port>'"
            )
        port = _derived_port(job)
    return LaunchEnv("mpirun", rank, size, local_rank, local_size, cross_rank, cross_size, addr, port)


_NODELIST_GROUP = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?")


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``gpu[01-03,07],login1`` into host names."""
    hosts: list[str] = []
    pos = 0
    text = nodelist.strip()
    while pos < len(text):
        m = _NODELIST_GROUP.match(text, pos)
        if m is None:
            raise LaunchEnvError(f"cannot parse Slurm node list {nodelist!r}")
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
        else:
            for part in ranges.split(","):
                lo, _, hi = part.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise LaunchEnvError(f"cannot parse Slurm node list {nodelist!r}")
                width = len(lo)
                for i in range(int(lo), int(hi or lo) + 1):
                    hosts.append(f"{prefix}{i:0{width}d}")
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise LaunchEnvError(f"cannot parse Slurm node list {nodelist!r}")
            pos += 1
    return hosts


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local_rank = _opt_int(env, "SLURM_LOCALID", 0) or 0
    nnodes = _opt_int(env, "SLURM_NNODES", None) or _opt_int(env, "SLURM_JOB_NUM_NODES", 1) or 1
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    m = re.match(r"(\d+)", per_node)
    local_size = int(m.group(1)) if m else -(-size // nnodes)
    cross_rank = _opt_int(env, "SLURM_NODEID", None)
    cross_rank = rank // local_size if cross_rank is None else cross_rank
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    addr = env.get("MASTER_ADDR") or (expand_slurm_nodelist(nodelist)[0] if nodelist else "127.0.0.1")
    port = _opt_int(env, "MASTER_PORT", None)
    if port is None and size > 1:
        port = _derived_port(env.get("SLURM_JOB_ID", "") + "." + env.get("SLURM_STEP_ID", ""))
    return LaunchEnv("slurm", rank, size, local_rank, local_size, cross_rank, max(nnodes, cross_rank + 1), addr, port)


def parse_env(env: Mapping[str, str]) -> LaunchEnv:
    """Describe this process's place in the job from its environment variables."""
    dialect = _dialect(env)
    return dataclasses.replace(
        dialect,
        # Only torchrun's workers have an agent store (see the module docstring).
        agent_store=(dialect.launcher == "torchrun"
                     and env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"),
        gloo_interface=env.get("GLOO_SOCKET_IFNAME") or None,
        secret=env.get("RINGTRAIN_JOB_SECRET", ""),
        version=_opt_int(env, "RINGTRAIN_WORLD_VERSION", 0) or 0,
        elastic_file=env.get("RINGTRAIN_ELASTIC_FILE", ""),
    )


def rendezvous_without_rank(env: Mapping[str, str]) -> bool:
    """``MASTER_ADDR`` / ``MASTER_PORT`` but no launcher's rank: what a script that starts
    its own processes (``mp.spawn(main, nprocs=world_size)``, the DDP tutorials) sets
    before ``init_process_group(rank=rank, world_size=world_size)``. Alone, such an
    environment is a 1-process world in every process."""
    named = bool(env.get("MASTER_ADDR", "").strip() or env.get("MASTER_PORT", "").strip())
    return named and _dialect(env).launcher == "none"


def from_group(env: LaunchEnv, rank: int, size: int, hosts: list[str],
               store_addr: tuple[str, int] | None) -> LaunchEnv:
    """The place of a process in a group the script started itself without a launcher:
    ``rank`` and ``size`` from the group, local and cross ranks from the host name of
    every rank (``hosts[r]``), hosts numbered in the order of their first rank."""
    me = hosts[rank]
    local = [r for r, h in enumerate(hosts) if h == me]
    order = list(dict.fromkeys(hosts))
    addr, port = store_addr if store_addr is not None else (env.master_addr, env.master_port)
    return dataclasses.replace(
        env, launcher="script", rank=rank, size=size, local_rank=local.index(rank),
        local_size=len(local), cross_rank=order.index(me), cross_size=len(order),
        master_addr=addr, master_port=port)


def _relaunched(env: Mapping[str, str]) -> bool:
    """ringrun's variables, but RANK / WORLD_SIZE that are not its own: a launcher that
    ringrun started (``ringrun -H a:1,b:1 torchrun --nproc-per-node 4 ...``) set them for
    this process, which is one of its workers, not one of ringrun's ranks. ringrun
    always sets both names to the same values (also in a resizable job's assignments).

    A torchrun with one worker per ringrun rank (``ringrun -np 2 sh -c 'torchrun --nnodes 2
    --nproc-per-node 1 --node-rank $RINGTRAIN_RANK ...'``) gives its workers ringrun's rank
    and size, but its own run id, store (MASTER_PORT) and restart count: ringrun sets
    TORCHELASTIC_RUN_ID to RINGTRAIN_RUN_ID, so another run id is another launcher's."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return False
    ours = (env.get("RINGTRAIN_RANK", "").strip(), env.get("RINGTRAIN_SIZE", "").strip())
    if (env["RANK"].strip(), env["WORLD_SIZE"].strip()) != ours:
        return True
    run_id, our_run_id = env.get("TORCHELASTIC_RUN_ID"), env.get("RINGTRAIN_RUN_ID")
    return run_id is not None and our_run_id is not None and run_id.strip() != our_run_id.strip()


def _dialect(env: Mapping[str, str]) -> LaunchEnv:
    if (env.get("RINGTRAIN_RANK") or env.get("RINGTRAIN_SIZE")) and not _relaunched(env):
        return _from_ringrun(env)
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        _require_together(env, ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), "OpenMPI")
        return _from_openmpi(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        # SLURM_STEP_ID is set inside `srun` steps only; a batch script's own shell
        # also has SLURM_PROCID but is not one rank of a parallel job.
        return _from_slurm(env)
    return LaunchEnv("none", 0, 1, 0, 1, 0, 1, "127.0.0.1", None)
