"""Run a job: start every rank, watch them, stop them all on the first failure, restart.

A job is a list of placements (rank -> host) and a command. Each attempt gets a fresh
rendezvous (new port, new ``RINGTRAIN_ATTEMPT`` key prefix) so nothing of a dead
attempt is reused. ``run_job`` returns the exit code ringrun should exit with.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ringtrain.launch.hosts import Placement, is_local_host
from ringtrain.launch.proc import OutputSink, Worker, stop_all

__all__ = ["JobConfig", "describe_exit", "run_job", "worker_env"]

log = logging.getLogger("ringtrain.launch")


@dataclass(frozen=True)
class JobConfig:
    command: tuple[str, ...]
    placements: tuple[Placement, ...]
    max_restarts: int = 0
    output_dir: str | None = None
    prefix_output: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Builds the argv that starts ``command`` with ``env`` on a remote host (ssh);
    #: None means every placement must be local.
    remote_argv: Callable[[str, dict[str, str], Sequence[str]], list[str]] | None = None
    #: Address other hosts use to reach rank 0's rendezvous (multi-host jobs).
    master_addr: str | None = None
    master_port: int | None = None
    cwd: str | None = None
    settings_env: dict[str, str] = field(default_factory=dict)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
    return 128 + (-code) if code < 0 else code


def _threads_per_worker(local_size: int) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_size))


def worker_env(
    p: Placement, size: int, addr: str, port: int, attempt: int, run_id: str, base: dict[str, str]
) -> dict[str, str]:
    """The environment contract between ringrun and ``rt.init()`` (also torchrun-compatible)."""
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
        RANK=str(p.rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(p.local_rank),
        LOCAL_WORLD_SIZE=str(p.local_size),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    # Without this every rank would start one thread per core and they would fight for
    # the same cores (torchrun sets OMP_NUM_THREADS=1 for the same reason).
    env.setdefault("OMP_NUM_THREADS", str(_threads_per_worker(p.local_size)))
    return env


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _listen_loopback() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    return sock


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind(("" if addr in ("0.0.0.0",) else addr, 0))
        return int(s.getsockname()[1])


def _start_attempt(cfg: JobConfig, attempt: int, run_id: str, sink: OutputSink) -> list[Worker]:
    size = len(cfg.placements)
    all_local = all(is_local_host(p.host) for p in cfg.placements)
    listener: socket.socket | None = None
    if all_local and cfg.master_port is None:
        # Bind the rendezvous socket here and hand it to rank 0: no port race, and a
        # one-host job listens on loopback only.
        listener = _listen_loopback()
        addr, port = "127.0.0.1", int(listener.getsockname()[1])
    else:
        addr = cfg.master_addr or "127.0.0.1"
        port = (cfg.master_port + attempt) if cfg.master_port else _free_port(addr)
    base = dict(os.environ)
    base.update(cfg.settings_env)
    workers: list[Worker] = []
    try:
        for p in cfg.placements:
            env = worker_env(p, size, addr, port, attempt, run_id, {})
            env.update(cfg.extra_env)
            if is_local_host(p.host):
                full = dict(base)
                full.update(env)
                fds: tuple[int, ...] = ()
                if listener is not None and p.rank == 0:
                    full["RINGTRAIN_STORE_FD"] = str(listener.fileno())
                    fds = (listener.fileno(),)
                workers.append(Worker(p.rank, cfg.command, full, sink, attempt, fds, cfg.cwd))
            else:
                if cfg.remote_argv is None:
                    raise RuntimeError(f"rank {p.rank} is placed on remote host {p.host} without ssh")
                env.update(cfg.settings_env)
                argv = cfg.remote_argv(p.host, env, cfg.command)
                workers.append(Worker(p.rank, argv, dict(base), sink, attempt, (), cfg.cwd, stdin_pipe=True))
    except BaseException:
        stop_all(workers)
        raise
    finally:
        if listener is not None:
            listener.close()  # rank 0 holds its own copy of the descriptor
    return workers


def _watch(workers: list[Worker], stop_flag: list[int]) -> tuple[Worker | None, int]:
    """Wait until all exit 0 (-> (None, 0)) or one fails (-> (worker, code))."""
    while True:
        if stop_flag:
            raise _Stop(stop_flag[0])
        running = False
        for w in workers:
            code = w.poll()
            if code is None:
                running = True
            elif code != 0:
                return w, code
        if not running:
            return None, 0
        time.sleep(0.05)


def run_job(cfg: JobConfig) -> int:
    """Run the job to completion; returns ringrun's exit code."""
    run_id = uuid.uuid4().hex[:12]
    sink = OutputSink(cfg.output_dir, cfg.prefix_output)
    stop_flag: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_flag.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    workers: list[Worker] = []
    try:
        for attempt in range(cfg.max_restarts + 1):
            workers = _start_attempt(cfg, attempt, run_id, sink)
            try:
                failed, code = _watch(workers, stop_flag)
            except _Stop as stop:
                name = signal.Signals(stop.signum).name
                _say(f"received {name}; stopping {len(workers)} rank(s)")
                stop_all(workers, grace=2.0)
                return 128 + stop.signum
            if failed is None:
                for w in workers:
                    w.finish_output()
                return 0
            others = sum(1 for w in workers if w is not failed and w.poll() is None)
            host = cfg.placements[failed.rank].host
            _say(
                f"rank {failed.rank} (pid {failed.pid} on {host}) {describe_exit(code)}; "
                f"stopping {others} other rank(s)"
            )
            stop_all(workers)
            if attempt < cfg.max_restarts:
                _say(f"restarting the job (restart {attempt + 1} of {cfg.max_restarts})")
                continue
            if cfg.max_restarts:
                _say(f"giving up after {cfg.max_restarts} restart(s)")
            return _exit_status(code)
        return 1  # unreachable: the loop always returns
    finally:
        stop_all(workers, grace=1.0)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _say(message: str) -> None:
    print(f"ringrun: {message}", file=sys.stderr, flush=True)
