"""A resizable job's workers, ringrun's side: start them, tell them their next world.

:class:`JobWorkers` owns the workers (:class:`WorkerProc`, one per started process,
numbered once for the job's life) and the hosts they run on (:class:`JobHost`); the
decisions of when and how the job changes size are the driver's
(:mod:`ringtrain.launch.elastic.driver`). A world is launched by reserving a rendezvous
port for each new worker (ringrun for this host, the agent for a remote one), starting
the new workers with the world's launch variables, and writing the world to the others'
assignment files (:mod:`ringtrain.assignment`; remote ones through their agent).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ringtrain import addresses, assignment, sockets
from ringtrain.launch import reaper
from ringtrain.launch.agent import agent_grace, worker_extras
from ringtrain.launch.elastic.worlds import WorkerOnHost, placements
from ringtrain.launch.horovod_env import horovod_env
from ringtrain.launch.hosts import Placement
from ringtrain.launch.job import (
    STOP_GRACE_S,
    HostsDown,
    JobConfig,
    Stopped,
    reach_address,
    worker_env,
    working_directory,
)
from ringtrain.launch.members import Member, Worker, stop_all
from ringtrain.launch.output import OutputSink
from ringtrain.launch.remote import RemoteHost
from ringtrain.launch.ssh import agent_command, forwarded_env, ssh_argv

__all__ = ["JobHost", "JobWorkers", "WorkerProc"]

#: Seconds a new host's agent has to reserve its workers' ports once it answered.
RESERVE_TIMEOUT_S = 10.0


@dataclass
class WorkerProc:
    """One worker: its host, its reserved rendezvous port, how far it got."""

    id: int
    host: str
    addr: str
    port: int
    started_in: int
    file: str
    local: Worker | None = None
    remote: RemoteHost | None = None
    joined: int = -1
    code: int | None = None
    #: ``time.monotonic()`` when its exit was seen: the first failure is the one named.
    exited_at: float = 0.0


@dataclass
class JobHost:
    """A host taken into the job: its agent (None: this host), addresses and workers."""

    name: str
    remote: RemoteHost | None  # None: this host (workers started here)
    addresses: list[str]
    reach: str  # the address the other hosts reach it at
    workers: list[int] = field(default_factory=list)


class JobWorkers:
    """The workers and hosts of one resizable job, and how a world is put in place."""

    def __init__(self, cfg: JobConfig, run_id: str, sink: OutputSink, stop_flag: list[int],
                 watchdog: reaper.Watchdog | None, directory: str) -> None:
        self.cfg, self.run_id, self.sink = cfg, run_id, sink
        self.stop_flag, self.watchdog, self.dir = stop_flag, watchdog, directory
        self.procs: dict[int, WorkerProc] = {}
        self.hosts: dict[str, JobHost] = {}
        #: Every address of every host of the job so far (workers sever them on leaving a world).
        self.addresses: set[str] = {"127.0.0.1"}

    def members(self) -> list[Member]:
        found: list[Member] = [p.local for p in self.procs.values() if p.local is not None]
        found += self.remotes().values()
        return found

    def remote(self, name: str, ids: list[int]) -> RemoteHost:
        argv = ssh_argv(name, self.cfg.ssh, agent_command(self.cfg.python))
        return RemoteHost(name, argv, tuple(ids), self.sink, 0, dict(os.environ))

    def register(self, name: str, remote: RemoteHost | None, infos: dict[str, dict[str, Any]]) -> JobHost:
        """Take host ``name`` into the job; ``infos``: the agents' facts of every remote host."""
        if remote is not None:
            own = list((remote.info or {}).get("ifaces", {}).values())
        else:
            own = list(addresses.interface_addresses().values())
        reach = reach_address(self.cfg, name, infos)  # loopback for a job of this host alone
        host = JobHost(name, remote, own, reach)
        self.hosts[name] = host
        self.addresses.update(a for a in own if a)
        self.addresses.add(reach)
        return host

    def remotes(self) -> dict[str, RemoteHost]:
        return {h.name: h.remote for h in self.hosts.values() if h.remote is not None}

    def overlay(self, p: Placement, size: int, addr: str, port: int, hvd: dict[int, dict[str, str]],
                 version: int) -> dict[str, str]:
        env = worker_env(p, size, addr, port, 0, self.run_id, {}, set_threads=False)
        env.update(hvd[p.rank])
        env["RINGTRAIN_WORLD_VERSION"] = str(version)
        return env

    def _reserve(self, host: JobHost, ids: list[int], version: int) -> dict[int, socket.socket]:
        """Reserve a rendezvous port for each new worker of ``host``."""
        held: dict[int, socket.socket] = {}
        if host.remote is None:
            for w in ids:
                held[w] = sockets.reserve(host.reach, 0)
                self.procs[w] = WorkerProc(w, host.name, host.reach, int(held[w].getsockname()[1]),
                                      version, assignment.worker_file(self.dir, w))
            return held
        host.remote.send_spec({"reserve": [{"id": w, "addr": host.reach} for w in ids]})
        if not host.remote.wait_reserved(ids, time.monotonic() + RESERVE_TIMEOUT_S):
            raise HostsDown(f"host {host.name} could not reserve rendezvous ports: {host.remote.problem()}")
        for w in ids:
            self.procs[w] = WorkerProc(w, host.name, host.reach, host.remote.reserved[w], version,
                                  assignment.worker_file(self.dir, w), remote=host.remote)
        return held

    def launch(self, order: list[WorkerOnHost], new: list[WorkerOnHost], lost: list[str], reason: str,
               version: int) -> None:
        """Make ``order`` world ``version``: start the ``new`` workers, tell the others."""
        places = {s.worker: p for s, p in zip(order, placements(order), strict=True)}
        hvd = horovod_env(list(places.values()))
        size = len(order)
        by_host: dict[str, list[int]] = {}
        for s in new:
            by_host.setdefault(s.host, []).append(s.worker)
        held: dict[int, socket.socket] = {}
        try:
            for name, ids in by_host.items():
                held.update(self._reserve(self.hosts[name], ids, version))
            rank0 = self.procs[order[0].worker]
            for name, ids in by_host.items():
                self._start(self.hosts[name], ids, places, hvd, size, rank0, held, version)
        except BaseException:
            self._undo(new)  # a rank that cannot start: the world is not announced
            raise
        finally:
            for sock in held.values():
                sock.close()  # each worker holds its own copy
        fresh = {s.worker for s in new}
        payloads: dict[str, dict[str, Any]] = {}
        for s in order:
            if s.worker in fresh:
                continue
            data = {"version": version, "env": self.overlay(places[s.worker], size, rank0.addr,
                                                                   rank0.port, hvd, version),
                    "lost": lost, "addresses": sorted(self.addresses), "reason": reason}
            proc = self.procs[s.worker]
            if proc.local is not None:
                assignment.write_assignment(proc.file, data)
            else:
                payloads.setdefault(proc.host, {})[str(s.worker)] = data
        for name, assign in payloads.items():
            remote = self.hosts[name].remote
            assert remote is not None
            remote.send_spec({"assign": assign})

    def _undo(self, new: list[WorkerOnHost]) -> None:
        """Stop the ``new`` workers this host started for a world that will not be
        announced (they joined nothing: the default grace at most) and take them off
        their hosts; the driver forgets them."""
        started = [self.procs[s.worker].local for s in new if s.worker in self.procs]
        stop_all([w for w in started if w is not None], grace=min(self.cfg.stop_grace, STOP_GRACE_S))
        for s in new:
            host = self.hosts.get(s.host)
            if host is not None and s.worker in host.workers:
                host.workers.remove(s.worker)

    def _start(self, host: JobHost, ids: list[int], places: dict[int, Placement],
               hvd: dict[int, dict[str, str]], size: int, rank0: WorkerProc,
               held: dict[int, socket.socket], version: int) -> None:
        cfg = self.cfg
        job_env = ({"GLOO_SOCKET_IFNAME": cfg.network_interface, "NCCL_SOCKET_IFNAME": cfg.network_interface}
                   if cfg.network_interface else {})
        if cfg.elastic is not None and cfg.elastic.elastic_timeout > 0:
            # Survivors of a loss wait for their next world as long as ringrun waits for
            # hosts (--elastic-timeout), and a little more for the world to be written.
            job_env["RINGTRAIN_REFORM_WAIT"] = f"{cfg.elastic.elastic_timeout + 30:g}"
        if "TORCH_CPP_LOG_LEVEL" not in os.environ and "TORCH_CPP_LOG_LEVEL" not in cfg.extra_env:
            # A lost peer is expected here: c10d would log each of the store's broken
            # connections (rank 0's store dies with it) as a warning with a C++ trace.
            # ringrun and the new rank 0 say what happened in one line each instead.
            job_env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        host.workers.extend(ids)
        if host.remote is not None:
            base = forwarded_env(os.environ, cfg.extra_env)
            base.update(cfg.settings_env)
            base.update(job_env)
            items = []
            for w in ids:
                env = dict(base)
                env.update(self.overlay(places[w], size, rank0.addr, rank0.port, hvd, version))
                env["RINGTRAIN_ELASTIC_FILE"] = self.procs[w].file
                items.append({"rank": w, "local_size": places[w].local_size, "env": env,
                              "label": f"rank {places[w].rank}",
                              "command": list(cfg.rank_command(places[w].local_rank))})
            host.remote.send_spec({"cwd": working_directory(cfg), "command": list(cfg.command),
                                   "ranks": items, "listen": None,
                                   "heartbeat_timeout": cfg.heartbeat_timeout,
                                   "stop_grace": agent_grace(cfg.stop_grace)})
            return
        os.makedirs(self.dir, exist_ok=True)
        for w in ids:
            if self.stop_flag:
                raise Stopped(self.stop_flag[0])
            p = places[w]
            full = dict(os.environ)
            full.update(cfg.settings_env)
            full.update(job_env)
            full.update(worker_env(p, size, rank0.addr, rank0.port, 0, self.run_id, {}))
            full.update(hvd[p.rank])
            full.update(cfg.extra_env)
            full.update(RINGTRAIN_WORLD_VERSION=str(version), RINGTRAIN_ELASTIC_FILE=self.procs[w].file,
                        RINGTRAIN_STORE_FD=str(held[w].fileno()))
            full.update(worker_extras(full, p.local_size, 1))
            worker = Worker(w, cfg.rank_command(p.local_rank), full, self.sink, 0, (held[w].fileno(),), cfg.cwd, host.name,
                            label=f"rank {p.rank}")  # the number it is known by is the worker's
            self.procs[w].local = worker
            if self.watchdog is not None:
                self.watchdog.watch_group(worker.pid)

    def remove(self, workers: list[int], version: int, reason: str) -> None:
        """Tell ``workers`` that world ``version`` goes on without them: they leave at
        their next commit (:mod:`ringtrain.elastic.resize`)."""
        payloads: dict[str, dict[str, Any]] = {}
        for w in workers:
            data = {"version": version, "env": {}, "removed": True, "reason": reason, "lost": [],
                    "addresses": sorted(self.addresses)}
            proc = self.procs[w]
            if proc.local is not None:
                assignment.write_assignment(proc.file, data)
            else:
                payloads.setdefault(proc.host, {})[str(w)] = data
        for name, assign in payloads.items():
            remote = self.hosts[name].remote
            assert remote is not None
            remote.send_spec({"assign": assign})

    def can_be_rank0(self, slot: WorkerOnHost, hosts: set[str]) -> bool:
        # Loopback is every host's own: rank 0 may listen there only when each host of
        # the world is this machine (two of its names, as Horovod's tests list them).
        remote = any(h in self.hosts and self.hosts[h].remote is not None for h in hosts)
        return not (remote and addresses.is_loopback(self.procs[slot.worker].addr))
