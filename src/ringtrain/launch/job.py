"""Run a job: start every rank, watch them, stop them all on the first failure, restart.

A job is a list of placements (rank -> host) and a command. Local ranks are child
processes (:class:`~ringtrain.launch.members.Worker`); each remote host is one ssh
connection to a host agent that runs that host's ranks
(:class:`~ringtrain.launch.remote.RemoteHost`). Each attempt gets a fresh rendezvous
(new listening socket, new ``RINGTRAIN_ATTEMPT`` key prefix) so nothing of a dead
attempt is reused. ``run_fixed`` returns the exit code ringrun should exit with.

An attempt starts in three steps: connect to every remote host and wait for its agent
(``--start-timeout``; the hosts that did not answer are named), choose rank 0's address
and reserve its rendezvous port there (ringrun reserves it for a local rank 0, the
agent for a remote one, so a port in use is reported before any worker starts), then
start the workers.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ringtrain import addresses, sockets
from ringtrain.cpus import cpu_count
from ringtrain.errors import ConfigError, LaunchError
from ringtrain.launch import reaper
from ringtrain.launch.agent import agent_grace, worker_extras
from ringtrain.launch.elastic.worlds import ElasticConfig
from ringtrain.launch.horovod_env import horovod_env
from ringtrain.launch.hosts import Placement, is_local_host
from ringtrain.launch.members import Member, StartFailure, Worker, stop_all, substitute_local_rank
from ringtrain.launch.output import OutputFailure, OutputSink
from ringtrain.launch.remote import HOST_LOST, RemoteHost
from ringtrain.launch.slurm import srun_argv
from ringtrain.launch.ssh import AGENT_SCRIPT, SshOptions, agent_command, forwarded_env, ssh_argv

__all__ = ["HEARTBEAT_EVERY_S", "STOP_GRACE_S", "HostsDown", "JobConfig", "JobRun", "Stopped",
           "await_agents", "choose_master_addr", "describe_exit", "exit_status", "job_run",
           "reach_address", "run_fixed", "say", "worker_env", "working_directory"]

#: Seconds without ringrun's heartbeat after which a host agent stops its ranks: a network
#: partition closes no connection, and the ranks must not outlive their job. Twice
#: ssh's own dead-peer detection (ServerAliveInterval 5 x CountMax 3, see ssh.py), so a
#: stalled but live ringrun is not mistaken for a partition.
HEARTBEAT_TIMEOUT_S = 30.0
HEARTBEAT_EVERY_S = 1.0

#: Seconds between stop request and SIGKILL (``--stop-grace``'s default); above the host
#: agent's own grace (1.5 s, ``agent.agent_grace``) so remote workers are stopped by
#: their agent, and below the 5 s a Ctrl-C may take. torchrun waits 30 s
#: (``--shutdown-timeout``); a longer grace is ``--stop-grace``.
STOP_GRACE_S = 2.5


@dataclass(frozen=True)
class JobConfig:
    command: tuple[str, ...]
    placements: tuple[Placement, ...]
    max_restarts: int = 0
    output_dir: str | None = None
    prefix_output: bool = True
    #: Each output line starts with the time it was written (``--timestamp-output``).
    timestamp_output: bool = False
    #: With ``output_dir``: the terminal gets the ranks' output too (``--output-tee``).
    tee_output: bool = False
    #: With ``output_dir``: the files' names (``--output-layout``, see
    #: :data:`ringtrain.launch.output.LAYOUTS`).
    output_layout: str = "log"
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Address other hosts use to reach rank 0's rendezvous (multi-host jobs).
    master_addr: str | None = None
    master_port: int | None = None
    cwd: str | None = None
    settings_env: dict[str, str] = field(default_factory=dict)
    ssh: SshOptions = field(default_factory=SshOptions)
    network_interface: str | None = None
    start_timeout: float = 30.0
    #: The interpreter that runs the host agent on remote hosts (same path everywhere).
    python: str = sys.executable
    #: Seconds of silence from ringrun after which a host agent stops its ranks.
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S
    #: Seconds the ranks have to end after they were asked to stop (a signal to ringrun,
    #: a failed rank, the end of the job) before SIGKILL (``--stop-grace``); remote
    #: ranks get :func:`~ringtrain.launch.agent.agent_grace` of it from their agent.
    stop_grace: float = STOP_GRACE_S
    #: The signal the ranks get when ringrun itself is asked to stop (``--stop-signal``):
    #: None passes on the one it received (SIGINT for Ctrl-C, as torchrun does);
    #: horovodrun gives SIGTERM, as Horovod's launcher sends its ranks on Ctrl-C.
    stop_signal: int | None = None
    #: What the user should know but that does not stop the job (``main`` prints it).
    warnings: tuple[str, ...] = ()
    #: How remote host agents are started: "ssh", or "srun" inside a Slurm allocation
    #: (then every node, this one too, is reached through a job step; see slurm.py).
    transport: str = "ssh"
    #: CPUs of the Slurm job on each node (srun transport), for the agent's job step.
    slurm_cpus: dict[str, int] = field(default_factory=dict)
    #: A resizable job (``--min-np/--max-np``, run by :mod:`ringtrain.launch.elastic`);
    #: then ``placements`` is empty and the hosts come from here.
    elastic: ElasticConfig | None = None
    #: ``hvd.run``'s result marker: its lines stay out of the ``--output-filename``
    #: files (:data:`ringtrain.processes.RESULT_MARKER_ENV`).
    result_marker: str | None = None
    #: Each local rank's command has torchrun's ``${local_rank}`` replaced in its
    #: arguments (:func:`~ringtrain.launch.members.substitute_local_rank`): ringrun's;
    #: horovodrun runs the command as Horovod's launcher does, untouched.
    local_rank_macro: bool = False

    def is_local(self, host: str) -> bool:
        """Whether ``host``'s ranks are started here directly (no agent)."""
        return self.transport == "ssh" and is_local_host(host)

    def rank_command(self, local_rank: int) -> tuple[str, ...]:
        """The command the rank with ``local_rank`` runs."""
        return substitute_local_rank(self.command, local_rank) if self.local_rank_macro else self.command

    @property
    def hosts(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.placements:
            seen.setdefault(p.host, None)
        return list(seen)

    @property
    def multi_host(self) -> bool:
        return any(not self.is_local(h) for h in self.hosts)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    return 128 + (-code) if code < 0 else code


_SECRETS: dict[str, str] = {}


def job_secret(run_id: str) -> str:
    """The job's secret (one per run id, the same for every attempt): it seals what
    ringtrain writes to the unauthenticated store (:mod:`ringtrain.signing`)."""
    if run_id not in _SECRETS:
        _SECRETS[run_id] = secrets.token_hex(16)
    return _SECRETS[run_id]


def worker_env(
    p: Placement, size: int, addr: str, port: int, attempt: int, run_id: str, base: dict[str, str],
    set_threads: bool = True, max_restarts: int = 0,
) -> dict[str, str]:
    """The environment contract between ringrun and ``rt.init()``; torchrun's names too,
    all but ``TORCHELASTIC_ERROR_FILE`` (a script's ``@record`` then logs its error
    instead of writing it to a file) and ``TORCHELASTIC_USE_AGENT_STORE`` (there is no
    agent store: the script's own ``init_process_group`` starts the store on rank 0)."""
    env = dict(base)
    env.update(
        RINGTRAIN_RANK=str(p.rank),
        RINGTRAIN_SIZE=str(size),
        RINGTRAIN_LOCAL_RANK=str(p.local_rank),
        RINGTRAIN_LOCAL_SIZE=str(p.local_size),
        RINGTRAIN_CROSS_RANK=str(p.cross_rank),
        RINGTRAIN_CROSS_SIZE=str(p.cross_size),
        RINGTRAIN_ATTEMPT=str(attempt),
        RINGTRAIN_RUN_ID=run_id,
        RINGTRAIN_JOB_SECRET=job_secret(run_id),
        RANK=str(p.rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(p.local_rank),
        LOCAL_WORLD_SIZE=str(p.local_size),
        GROUP_RANK=str(p.cross_rank),
        GROUP_WORLD_SIZE=str(p.cross_size),
        ROLE_NAME="default",
        ROLE_RANK=str(p.rank),
        ROLE_WORLD_SIZE=str(size),
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
        TORCHELASTIC_RUN_ID=run_id,
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    # Without this every rank would start one thread per core and they would fight for
    # the same cores (torchrun sets OMP_NUM_THREADS=1 for the same reason). A value in
    # ringrun's own environment wins, as under torchrun (the local ranks' environment is
    # ringrun's with this laid over it). Remote hosts count their own cores (the host
    # agent fills it in).
    if set_threads and "OMP_NUM_THREADS" not in os.environ:
        env.setdefault("OMP_NUM_THREADS", str(cpu_count(share=p.local_size)))
    return env


class Stopped(Exception):
    """ringrun received a signal (its number): every worker is to be stopped."""

    def __init__(self, signum: int) -> None:
        self.signum = signum


class HostsDown(Exception):
    """Some remote hosts did not come up (fatal at the first attempt, retried later)."""


class _OutputFailed(Exception):
    def __init__(self, failure: OutputFailure) -> None:
        self.failure = failure


def choose_master_addr(cfg: JobConfig, infos: dict[str, dict[str, Any]]) -> str:
    """The address every rank reaches rank 0's rendezvous at.

    ``--master-addr`` wins; then the address of ``--network-interface`` on rank 0's host;
    then, for a remote rank 0, the address ringrun reached that host at (ssh tells the
    agent), and for a local rank 0 in a multi-host job the address the first remote host
    sees ringrun's host at. A one-host job stays on loopback.
    """
    if cfg.master_addr:
        return cfg.master_addr
    return reach_address(cfg, cfg.placements[0].host, infos)


def reach_address(cfg: JobConfig, host0: str, infos: dict[str, dict[str, Any]]) -> str:
    """The address every host reaches ``host0`` at (see :func:`choose_master_addr`)."""
    iface = cfg.network_interface
    if cfg.is_local(host0):
        if not infos:
            return "127.0.0.1"
        if iface:
            addr = addresses.address_of_interface(iface)
            if addr is None:
                raise ConfigError(f"--network-interface {iface} has no IPv4 address on this host "
                                  f"(it has {', '.join(addresses.interface_addresses())})")
            return addr
        first_host, first = next(iter(infos.items()))
        addr = first.get("client_addr") or addresses.source_address_for(
            addresses.resolve(first_host) or first_host)
        if not addr:
            raise ConfigError(f"cannot tell which address of this host {first_host} can reach; "
                              "pass --master-addr or --network-interface")
        return str(addr)
    info = infos[host0]
    if iface:
        addr = info["ifaces"].get(iface)
        if addr is None:
            raise ConfigError(f"--network-interface {iface} does not exist on host {host0} (it has "
                              f"{', '.join(info['ifaces'])}); pick an interface every host has")
        return str(addr)
    addr = info.get("server_addr") or addresses.resolve(host0)
    if not addr:
        raise ConfigError(f"cannot resolve host {host0}; pass --master-addr")
    return str(addr)


def await_agents(cfg: JobConfig, remote: dict[str, RemoteHost], attempt: int,
                  stop_flag: list[int]) -> None:
    """Wait for every agent's ready line; raise HostsDown naming the hosts that failed."""
    deadline = time.monotonic() + cfg.start_timeout
    pending = set(remote)
    refused: dict[str, str] = {}
    while pending and time.monotonic() < deadline:
        if stop_flag:
            raise Stopped(stop_flag[0])
        for host in sorted(pending):
            h = remote[host]
            if h.wait_ready(time.monotonic() + 0.01):
                pending.discard(host)
                refused.pop(host, None)
            elif h.ssh_done():
                refused[host] = h.problem()
                if attempt == 0 and cfg.transport != "srun":
                    pending.discard(host)  # a typo or a host that was never up: no point waiting
                else:
                    # A host that died may be rebooting: keep trying until the deadline.
                    # Under srun every node is the allocation's own, so a refusal even on
                    # the first attempt is Slurm not ready yet: a requeued job can start
                    # while a node back from a failure still refuses steps ("Requested
                    # node configuration is not available") for a moment.
                    time.sleep(0.3)
                    h.connect()
    if refused or pending:
        parts = []
        if refused:
            parts.append("could not start the host agent on "
                         + "; ".join(f"{h} ({why})" for h, why in refused.items()))
        late = sorted(pending - set(refused))
        if late:
            parts.append(f"host(s) {', '.join(late)} did not come up within {cfg.start_timeout:g}s ("
                         + "; ".join(remote[h].problem() for h in late) + ")")
        port = f"-p {cfg.ssh.port} " if cfg.ssh.port else ""
        check = ("check that 'srun --nodes=1 --nodelist=NODE true' works in this allocation"
                 if cfg.transport == "srun" else f"check that 'ssh {port}HOST true' works without a password")
        raise HostsDown(f"{'; '.join(parts)}; {check}" + (", or raise --start-timeout" if late else ""))


def _connect_hosts(cfg: JobConfig, attempt: int, sink: OutputSink,
                   stop_flag: list[int]) -> dict[str, RemoteHost]:
    remote: dict[str, RemoteHost] = {}
    by_host: dict[str, list[int]] = {}
    for p in cfg.placements:
        if not cfg.is_local(p.host):
            by_host.setdefault(p.host, []).append(p.rank)
    command = agent_command(cfg.python)
    try:
        for host, ranks in by_host.items():
            if cfg.transport == "srun":
                argv = srun_argv(host, cfg.python, str(AGENT_SCRIPT), cfg.slurm_cpus.get(host))
            else:
                argv = ssh_argv(host, cfg.ssh, command)
            remote[host] = RemoteHost(host, argv, tuple(ranks), sink, attempt, dict(os.environ))
        await_agents(cfg, remote, attempt, stop_flag)
    except BaseException:
        stop_all(list(remote.values()), grace=0.5)
        raise
    return remote


def _start_attempt(cfg: JobConfig, attempt: int, run_id: str, sink: OutputSink,
                   stop_flag: list[int], watchdog: reaper.Watchdog | None) -> list[Member]:
    size = len(cfg.placements)
    remote = _connect_hosts(cfg, attempt, sink, stop_flag)
    members: list[Member] = list(remote.values())
    hvd = horovod_env(cfg.placements)
    listener: socket.socket | None = None
    try:
        addr = choose_master_addr(cfg, {h: r.info or {} for h, r in remote.items()})
        host0 = cfg.placements[0].host
        net_env: dict[str, str] = {}
        if cfg.network_interface and remote:
            net_env = {"GLOO_SOCKET_IFNAME": cfg.network_interface,
                       "NCCL_SOCKET_IFNAME": cfg.network_interface}
        cwd = working_directory(cfg)
        if cfg.is_local(host0):
            listener = sockets.reserve_rendezvous(addr, cfg.master_port or 0)
            port = int(listener.getsockname()[1])
        else:
            # The agent of rank 0's host binds the socket and tells us the port.
            h0 = remote[host0]
            h0.send_spec(_spec(cfg, h0, addr, 0, attempt, run_id, cwd, net_env, hvd,
                               listen={"addr": addr, "port": cfg.master_port or 0}))
            got = h0.wait_port(time.monotonic() + cfg.start_timeout)
            if got is None:
                raise LaunchError(f"host {host0} could not open the rendezvous: {h0.problem()}")
            port = got
        for host, h in remote.items():
            if host != host0:
                h.send_spec(_spec(cfg, h, addr, port, attempt, run_id, cwd, net_env, hvd, listen=None))
        base = dict(os.environ)
        base.update(cfg.settings_env)
        base.update(net_env)
        for p in cfg.placements:
            if not cfg.is_local(p.host):
                continue
            if stop_flag:  # a signal while many ranks start: stop now, not after the last
                raise Stopped(stop_flag[0])
            env = worker_env(p, size, addr, port, attempt, run_id, {}, max_restarts=cfg.max_restarts)
            env.update(hvd[p.rank])
            env.update(cfg.extra_env)
            full = dict(base)
            full.update(env)
            full.update(worker_extras(full, p.local_size, 1))
            fds: tuple[int, ...] = ()
            if listener is not None and p.rank == 0:
                full["RINGTRAIN_STORE_FD"] = str(listener.fileno())
                fds = (listener.fileno(),)
            # Rank 0 reads ringrun's stdin (``cat data | ringrun ...``, a pdb prompt), as
            # under mpirun; torchrun and horovodrun give it to every local rank, and
            # whichever reads first takes it. The others read nothing (/dev/null).
            worker = Worker(p.rank, cfg.rank_command(p.local_rank), full, sink, attempt, fds, cfg.cwd, p.host,
                            inherit_stdin=p.rank == 0)
            members.append(worker)
            if watchdog is not None:
                watchdog.watch_group(worker.pid)
    except BaseException:
        stop_all(members, grace=cfg.stop_grace)
        raise
    finally:
        if listener is not None:
            listener.close()  # rank 0 holds its own copy of the reservation
    return members


def working_directory(cfg: JobConfig) -> str:
    """The directory the ranks start in: ``cfg.cwd``, else ringrun's own (the same path
    on every host)."""
    if cfg.cwd:
        return cfg.cwd
    try:
        return os.getcwd()
    except FileNotFoundError:  # removed while ringrun was in it
        raise ConfigError("ringrun's working directory no longer exists; cd to an existing "
                          "directory and start the job again") from None


def _spec(cfg: JobConfig, h: RemoteHost, addr: str, port: int, attempt: int, run_id: str,
          cwd: str, net_env: dict[str, str], hvd: dict[int, dict[str, str]],
          listen: dict[str, Any] | None) -> dict[str, Any]:
    size = len(cfg.placements)
    base = forwarded_env(os.environ, cfg.extra_env)
    base.update(cfg.settings_env)
    base.update(net_env)
    ranks = []
    for r in h.ranks:
        p = cfg.placements[r]
        env = worker_env(p, size, addr, port, attempt, run_id, base, set_threads=False,
                         max_restarts=cfg.max_restarts)
        env.update(hvd[r])
        ranks.append({"rank": r, "local_size": p.local_size, "env": env,
                      "command": list(cfg.rank_command(p.local_rank))})
    return {"cwd": cwd, "command": list(cfg.command), "ranks": ranks, "listen": listen,
            "heartbeat_timeout": cfg.heartbeat_timeout, "stop_grace": agent_grace(cfg.stop_grace)}


def _failures(members: list[Member]) -> tuple[list[tuple[float, int, Member, int]], int]:
    """The ranks that failed so far, as (when the exit was seen, rank, member, code), and
    how many exited 0."""
    failed: list[tuple[float, int, Member, int]] = []
    done = 0
    for m in members:
        for rank, code in m.exits().items():
            if code == 0:
                done += 1
            else:
                when = m.exit_time(rank)
                failed.append((time.monotonic() if when is None else when, rank, m, code))
    return failed, done


def _watch(members: list[Member], stop_flag: list[int],
           sink: OutputSink) -> tuple[Member | None, int, int]:
    """Wait until all exit 0 (-> (None, -1, 0)) or one fails (-> (member, rank, code)).

    The failed rank is the one whose exit was seen first, as torchrun names the failure
    with the earliest time its "root cause": a rank that fails second, because its peer
    died, is not the cause."""
    total = sum(len(m.ranks) for m in members)
    next_beat = 0.0
    while True:
        if stop_flag:
            raise Stopped(stop_flag[0])
        if sink.failure is not None:
            raise _OutputFailed(sink.failure)
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + HEARTBEAT_EVERY_S
            for m in members:
                if isinstance(m, RemoteHost):
                    m.heartbeat()
        failed, done = _failures(members)
        if failed:
            # A rank that exited after this look passed it, but before a later rank's
            # exit that this look saw, failed first: look once more, then take the first.
            failed, _ = _failures(members)
            _when, rank, member, code = min(failed, key=lambda f: (f[0], f[1]))
            return member, rank, code
        if done == total:
            return None, -1, 0
        time.sleep(0.05)


def _failure_text(member: Member, rank: int, code: int, others: int) -> str:
    if isinstance(member, RemoteHost) and member.error:
        return f"host {member.host}: {member.error}; stopping {others} other rank(s)"
    if isinstance(member, RemoteHost) and member.lost() and code == HOST_LOST:
        why = member.problem() if member.ssh_tail else "the connection closed"
        return (f"host {member.host} was lost ({why}) with ranks "
                f"{', '.join(map(str, member.ranks))}; stopping {others} other rank(s)")
    return f"rank {rank} ({member.where(rank)}) {describe_exit(code)}; stopping {others} other rank(s)"


@dataclass(frozen=True)
class JobRun:
    """What one run of ringrun holds whichever engine drives it."""

    run_id: str
    sink: OutputSink
    stop_flag: list[int]  # the signals received, appended by the handler
    watchdog: reaper.Watchdog | None
    local: bool  # some rank runs on this host


@contextmanager
def job_run(cfg: JobConfig, local: bool) -> Iterator[JobRun]:
    """A run id, the output sink, signal handlers that only record, and (``local``) the
    reaper watchdog; the handlers are restored and the watchdog closed on the way out."""
    # The rank padding of the "horovod" layout: the job's size; a resizable job's first
    # world's, as Horovod pads by -np (whose --max-np may be unbounded).
    size = (cfg.elastic.np or cfg.elastic.min_np) if cfg.elastic is not None else len(cfg.placements)
    run_id, sink = uuid.uuid4().hex[:12], OutputSink(cfg.output_dir, cfg.prefix_output,
                                                      timestamp=cfg.timestamp_output,
                                                      tee=cfg.tee_output,
                                                      hide=(cfg.result_marker or "").encode(),
                                                      layout=cfg.output_layout, size=size)
    stop_flag: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_flag.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    watchdog = None
    try:
        # Outlives a SIGKILLed ringrun to end what its local ranks started (see
        # reaper.py). Without local ranks there is nothing of the job here to end:
        # each agent ends its own.
        watchdog = reaper.Watchdog(run_id) if local else None
        yield JobRun(run_id, sink, stop_flag, watchdog, local)
    finally:
        if watchdog is not None:
            watchdog.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_fixed(cfg: JobConfig) -> int:
    """Run a fixed-size job to completion; returns ringrun's exit code."""
    with job_run(cfg, any(cfg.is_local(h) for h in cfg.hosts)) as run:
        started: list[int] = []
        try:
            return _run_attempts(cfg, run, started)
        finally:
            if not started:  # no attempt got all its ranks going: no empty logs left
                run.sink.remove_unused()


def _run_attempts(cfg: JobConfig, run: JobRun, started: list[int]) -> int:
    """Run the attempts; each one whose ranks all started is appended to ``started``."""
    run_id, sink, stop_flag, watchdog = run.run_id, run.sink, run.stop_flag, run.watchdog
    mark = run_id if run.local else None
    members: list[Member] = []
    try:
        for attempt in range(cfg.max_restarts + 1):
            try:
                members = []
                members = _start_attempt(cfg, attempt, run_id, sink, stop_flag, watchdog)
                started.append(attempt)
                failed, rank, code = _watch(members, stop_flag, sink)
            except Stopped as stop:
                name = signal.Signals(stop.signum).name
                say(f"received {name}; stopping {len(cfg.placements)} rank(s)")
                # The ranks get the signal ringrun got, as under torchrun (members.Rank);
                # another one cuts their grace short.
                _stop_everything(cfg, members, mark, cfg.stop_signal or stop.signum,
                                 cut_short=lambda: len(stop_flag) > 1)
                members = []
                return 128 + stop.signum
            except _OutputFailed as out:
                _stop_everything(cfg, members, mark)
                say(f"error: {out.failure.message}; stopped the job's {len(cfg.placements)} rank(s)")
                return out.failure.exit_code
            except HostsDown as down:
                if attempt == 0:
                    raise LaunchError(str(down)) from None
                failed, rank, code = None, -1, HOST_LOST
                say(str(down))
            except StartFailure as refused:
                # A failed attempt, as a rank that dies is, while restarts remain and a
                # try may get past it (no file descriptors, memory or processes left for
                # a moment); a program that cannot run at all ends the job at once, on
                # any attempt, rather than burning every restart on the same error.
                if refused.repeats or not cfg.max_restarts:
                    raise
                failed, rank, code = None, -1, 1
                say(str(refused))
            else:
                if failed is None:
                    for m in members:
                        m.finish_output()
                    if sink.failure is not None:  # the last lines could not be written
                        say(f"error: {sink.failure.message}")
                        return sink.failure.exit_code
                    return 0
                cannot = next((m for m in members if isinstance(m, RemoteHost) and m.start_repeats), None)
                if cannot is not None:
                    # A rank its agent cannot start, nor would on a restart (see StartFailure).
                    raise LaunchError(f"host {cannot.host}: {cannot.error}")
                others = sum(len(m.ranks) - len(m.exits()) for m in members if m is not failed)
                say(_failure_text(failed, rank, code, others))
                _stop_everything(cfg, members, mark, cut_short=lambda: bool(stop_flag))
            if attempt < cfg.max_restarts:
                say(f"restarting the job (restart {attempt + 1} of {cfg.max_restarts})")
                continue
            if cfg.max_restarts:
                say(f"giving up after {cfg.max_restarts} restart(s)")
            return exit_status(code)
        return 1  # unreachable: the loop always returns
    finally:
        _stop_everything(cfg, members, mark, cut_short=lambda: bool(stop_flag))


def _stop_everything(cfg: JobConfig, members: list[Member], mark: str | None, signum: int = signal.SIGTERM,
                     cut_short: Callable[[], bool] | None = None) -> None:
    """Stop every member (asked with ``signum``, SIGKILL after ``--stop-grace`` or once
    ``cut_short()``) and what escaped their process groups on this host (``setsid``
    children, a shell's grandchildren): everything marked with the run id ``mark``."""
    stop_all(members, grace=cfg.stop_grace, run_id=mark, signum=signum, cut_short=cut_short)


def say(message: str) -> None:
    """One ``ringrun: ...`` line on stderr."""
    try:
        print(f"ringrun: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr is gone too (``ringrun ... 2>&1 | head``): nothing left to tell
