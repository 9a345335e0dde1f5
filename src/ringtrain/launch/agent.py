"""The host agent: ringrun starts it over ssh, once per remote host and attempt.

It runs as a plain script (``python .../ringtrain/launch/agent.py``) with the standard
library only, so a host answers in tens of milliseconds instead of importing torch.
ssh carries no signals, so the agent is tied to its ssh session through stdin: when
stdin closes (ringrun stopped the job, died, or the connection broke), when ringrun's
heartbeat (an empty line every second) has been missing for ``heartbeat_timeout``
seconds (a network partition, where no connection closes), or when a SIGTERM / SIGHUP
arrives, it stops every worker's process group, SIGKILLs what is left after a grace
period, and exits. Each worker also gets PR_SET_PDEATHSIG, so a SIGKILLed agent
takes its workers along.

Protocol (one line each; ``<rank>`` is the global rank):

ringrun <- agent   ``R {json}``       ready: host name, cpus, interfaces, ssh addresses
ringrun -> agent   ``{json}``         the spec: cwd, command, ranks with their env, for
                                      rank 0's host the address (and port) to listen on,
                                      and ``stop_grace``: the seconds between asking the
                                      ranks to stop and SIGKILL (default 1.5)
                   empty lines        heartbeats, about one a second
                   ``{"stop_signal": N}``  stop the ranks with signal N, not SIGTERM (the
                                      SIGINT / SIGHUP ringrun got), when input ends
ringrun <- agent   ``L <port>``       rank 0's rendezvous port is reserved (bound) on this port
                   ``S <rank> <pid>`` a worker started
                   ``O <rank> <text>``  one line of a worker's stdout
                   ``P <rank> <text>``  a piece of a longer line (at most 64 KiB; the
                                      newline ending this protocol line is not in it)
                   ``T <rank> <text>``  its last piece, which ended without a newline
                                      (the newline ending this protocol line is not in it)
                   ``O2``, ``P2``, ``T2 <rank> <text>``  the same for its stderr,
                                      which ringrun writes to its own stderr
                   ``X <rank> <code>``  a worker exited (negative: killed by that signal)
                   ``E <message>``    the agent could not do what the spec asked
                   ``F <message>``    as ``E``, for a rank that could not be started and
                                      would not be on another try (no such program, not
                                      executable, a bad '#!' line): no restart helps

A resizable job (``ringrun --min-np/--max-np``, :mod:`ringtrain.launch.elastic`) names
workers by a number of their own instead of ``<rank>`` (ranks change as the job does)
and adds:

ringrun -> agent   ``{"reserve": [{"id": N, "addr": A}, ...]}``  before the spec: reserve
                                      a rendezvous port on A for each worker (each may
                                      become rank 0 of a later world); the spec's worker
                                      N inherits it as RINGTRAIN_STORE_FD
ringrun <- agent   ``K <id> <port>``  worker <id>'s port is reserved
ringrun -> agent   ``{"assign": {"<id>": {...}}}``  after the spec: write each worker's
                                      next world to its RINGTRAIN_ELASTIC_FILE
ringrun <- agent   ``J <id> <version>``  worker <id> joined world <version> (its ack file)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

if not __package__:
    # Run as a plain script (ssh, srun): import this tree's ringtrain as a package. The
    # script's own folder, which Python put first on the path, goes: its modules would
    # shadow the standard library's and ringtrain's own names.
    sys.path[0] = str(Path(__file__).resolve().parents[2])

# Standard library only, as this module: the agent must answer without importing torch.
from ringtrain import addresses, assignment, sockets  # noqa: E402
from ringtrain.cpus import cpu_count  # noqa: E402
from ringtrain.errors import ConfigError  # noqa: E402
from ringtrain.launch import reaper  # noqa: E402
from ringtrain.launch.members import Rank, stop_marked  # noqa: E402
from ringtrain.processes import start_failure, start_failure_repeats  # noqa: E402

__all__ = ["agent_grace", "info", "main", "worker_extras"]

#: Seconds the workers have to stop before they are killed, when the spec names none
#: (``agent_grace`` of ringrun's default, launch/job.py's STOP_GRACE_S).
GRACE_S = 1.5
#: How much sooner than ringrun the agent kills: its last lines and exit reports must
#: reach ringrun before ringrun kills the ssh client.
AGENT_MARGIN_S = 1.0


def agent_grace(grace: float) -> float:
    """The grace an agent gives its ranks when ringrun's is ``grace`` (``--stop-grace``):
    :data:`AGENT_MARGIN_S` less, so the agent has stopped them and said so when ringrun
    would kill the connection; half of it below 2 s, so a short grace is not none."""
    return max(grace - AGENT_MARGIN_S, grace / 2)


def info() -> dict[str, Any]:
    """What ringrun needs to know about this host before it places rank 0."""
    conn = os.environ.get("SSH_CONNECTION", "").split()
    # The address ringrun's host reached us at, and its own as we see it: from ssh, or,
    # started by srun, from the node srun ran on and the route to it.
    server, client = (conn[2], conn[0]) if len(conn) == 4 else (None, None)
    launch_node = os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if client is None and launch_node:
        client, server = launch_node, addresses.source_address_for(launch_node)
    return {
        "host": socket.gethostname(),
        "cpus": cpu_count(),
        "ifaces": addresses.interface_addresses(),
        "server_addr": server,
        "client_addr": client,
    }


def worker_extras(env: dict[str, str], local_size: int, cpus: int) -> dict[str, str]:
    """Variables the agent fills in from this host's own facts (when ringrun left them unset)."""
    extra: dict[str, str] = {}
    if "OMP_NUM_THREADS" not in env:
        extra["OMP_NUM_THREADS"] = str(max(1, cpus // max(1, local_size)))
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env:
        # torchrun's default for its workers (local_elastic_agent.py): a failed or timed-out
        # NCCL collective aborts the communicators and ends the process (torch's own
        # default, 3, ends it without the abort). A resizable job's worker (ringrun
        # --min-np/--max-np: it has an assignment file) must outlive a lost peer to join
        # the next world: 2 aborts the communicators (the kernel spinning on the lost
        # peer ends, the waiting call raises) but leaves the process up; under 1 the
        # watchdog rethrew the error on its own thread and every survivor died (SIGABRT).
        resizable = bool(env.get("RINGTRAIN_ELASTIC_FILE"))
        extra["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2" if resizable else "1"
    master = env.get("MASTER_ADDR", "")
    if master and not addresses.is_loopback(master) and "GLOO_SOCKET_IFNAME" not in env:
        # Gloo otherwise binds whatever the host name resolves to, often 127.0.1.1 or an
        # address other hosts cannot reach; use the interface that routes to rank 0.
        iface = addresses.interface_towards(master)
        if iface:
            extra["GLOO_SOCKET_IFNAME"] = iface
            if "NCCL_SOCKET_IFNAME" not in env:
                extra["NCCL_SOCKET_IFNAME"] = iface
    return extra


class _Agent:
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.procs: dict[int, Rank] = {}
        self.stopping = threading.Event()
        self.last_heard = time.monotonic()
        self.heartbeat_timeout = 0.0  # 0: no heartbeat expected
        self.grace = GRACE_S  # the spec's stop_grace, once it came
        self.run_id: str | None = None
        self.watchdog: reaper.Watchdog | None = None
        #: Resizable jobs: each worker's reserved rendezvous socket and world files.
        self.reserved: dict[int, socket.socket] = {}
        self.files: dict[int, str] = {}
        self.acked: dict[int, int] = {}

    def send(self, line: bytes) -> None:
        with self.lock:
            try:
                self.out.write(line if line.endswith(b"\n") else line + b"\n")
                self.out.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.stopping.set()  # ringrun is gone: stop the workers

    def _send_nowait(self, text: str) -> None:
        if not self.lock.acquire(timeout=0.5):
            return
        try:
            os.set_blocking(self.out.fileno(), False)
            self.out.write(text.encode() + b"\n")
            self.out.flush()
        except (OSError, ValueError):
            pass
        finally:
            self.lock.release()

    def start(self, spec: dict[str, Any], listener: socket.socket | None) -> None:
        cwd = spec.get("cwd")
        if cwd and not os.path.isdir(cwd):
            raise _Refused(f"working directory {cwd} does not exist on host {socket.gethostname()}; "
                           "the same path must exist on every host")
        cpus = info()["cpus"]
        self.run_id = next((str(item["env"][reaper.MARK]) for item in spec["ranks"]
                            if reaper.MARK in item["env"]), None)
        if self.run_id:  # ends what the ranks started should this agent be SIGKILLed
            self.watchdog = reaper.Watchdog(self.run_id)
        for item in spec["ranks"]:
            rank = int(item["rank"])
            env = dict(os.environ)
            env.update(item["env"])
            env.update(worker_extras(item["env"], int(item["local_size"]), cpus))
            fds: tuple[int, ...] = ()
            if listener is not None and rank == 0:
                env["RINGTRAIN_STORE_FD"] = str(listener.fileno())
                fds = (listener.fileno(),)
            if rank in self.reserved:
                env["RINGTRAIN_STORE_FD"] = str(self.reserved[rank].fileno())
                fds = (self.reserved[rank].fileno(),)
            world_file = item["env"].get("RINGTRAIN_ELASTIC_FILE")
            if world_file:
                self.files[rank] = world_file
                try:
                    os.makedirs(os.path.dirname(world_file) or ".", exist_ok=True)
                except OSError as exc:
                    raise _Refused(f"cannot create {os.path.dirname(world_file)} on host "
                                   f"{socket.gethostname()} ({exc.strerror}); check that the "
                                   "working directory is writable there") from None
            try:
                # (a rank's own command: torchrun's ${local_rank} already replaced in it)
                command = item.get("command") or spec["command"]
                proc = Rank(command, env, cwd=cwd or None, pass_fds=fds)
            except OSError as exc:  # the caller stops the ranks started before this one
                # "label": a resizable job's worker number is not its rank (see above).
                raise _Refused(start_failure(
                    f"{item.get('label') or f'rank {rank}'} on host {socket.gethostname()}",
                    command, exc,
                    missing="check PATH there (pass it with -x PATH) and a script's '#!' "
                            "interpreter"), repeats=start_failure_repeats(exc)) from None
            self.procs[rank] = proc
            if rank in self.reserved:
                self.reserved.pop(rank).close()  # the worker holds its own copy
            if self.watchdog is not None:
                self.watchdog.watch_group(proc.pid)
            self.send(f"S {rank} {proc.pid}".encode())
            proc.pump(self._relay_output(rank, ""), self._relay_output(rank, "2"))

    def _relay_output(self, rank: int, stream: str) -> Callable[[bytes, bool], None]:
        """Relay one stream of ``rank``'s output: ``stream`` "" for stdout, "2" for stderr."""
        line_head, piece_head = f"O{stream} {rank} ".encode(), f"P{stream} {rank} ".encode()
        last_head = f"T{stream} {rank} ".encode()

        def relay(piece: bytes, partial: bool) -> None:
            # Bounded pieces: a 200 MB line costs one piece of memory here and in ringrun.
            # A last piece without a newline ("T", its tail): as a line, the framing newline would
            # reach the rank's output file, which holds the bytes as written; as a piece,
            # the terminal would keep its line open for more.
            if partial:
                self.send(piece_head + piece + b"\n")
            elif not piece.endswith(b"\n"):
                self.send(last_head + piece + b"\n")
            else:
                self.send(line_head + piece)

        return relay

    def watch(self) -> int:
        """Report exits until every worker is done or a stop is requested; the exit code."""
        reported: dict[int, int] = {}
        while len(reported) < len(self.procs):
            quiet = time.monotonic() - self.last_heard
            if self.heartbeat_timeout and quiet > self.heartbeat_timeout:
                # Partitioned: the way back to ringrun may be blocked (a full pipe to sshd),
                # so stop the ranks first and report without waiting on that way.
                self.stop()
                self._send_nowait(f"E no word from ringrun for {quiet:.0f}s; stopped this host's ranks")
                return 3
            if self.stopping.is_set():
                self.stop()
            self._relay_acks()
            exited = [(rank, proc, code) for rank, proc in self.procs.items()
                      if rank not in reported and (code := proc.poll()) is not None]
            # In the order they exited, which ringrun takes for the order they failed in.
            for rank, proc, code in sorted(exited, key=lambda e: e[1].exited_at or 0.0):
                proc.join_output(1.0)  # its last lines before its exit
                reported[rank] = code
                self.send(f"X {rank} {code}".encode())
            time.sleep(0.02)
        return next((abs(c) for c in reported.values() if c != 0), 0)

    def reserve(self, items: list[dict[str, Any]]) -> None:
        """Reserve a rendezvous port for each worker of a resizable job; report them."""
        for item in items:
            sock = _reserve(str(item["addr"]), 0)  # port 0: a free one
            self.reserved[int(item["id"])] = sock
            self.send(f"K {int(item['id'])} {sock.getsockname()[1]}".encode())

    def control(self, message: dict[str, Any]) -> None:
        """A line from ringrun after the spec: the signal to stop the ranks with, or the
        workers' next worlds."""
        if "stop_signal" in message:
            for proc in self.procs.values():
                proc.stop_signal = int(message["stop_signal"])
        for key, world in (message.get("assign") or {}).items():
            path = self.files.get(int(key))
            if path:
                try:
                    assignment.write_assignment(path, world)
                except OSError as exc:
                    self.send(f"E cannot write {path} on host {socket.gethostname()}: {exc.strerror}".encode())

    def _relay_acks(self) -> None:
        for worker, path in self.files.items():
            version = assignment.read_ack(path)
            if version is not None and self.acked.get(worker) != version:
                self.acked[worker] = version
                self.send(f"J {worker} {version}".encode())

    def remove_files(self) -> None:
        for path in self.files.values():
            for name in (path, assignment.ack_path(path)):
                try:
                    os.unlink(name)
                except OSError:
                    pass
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass  # other workers' files are still there (or it is gone)

    def stop(self) -> None:
        """Every worker's group, and what left them (setsid, a shell's grandchildren)."""
        stop_marked(list(self.procs.values()), self.grace, self.run_id)

    def close_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()


class _Refused(Exception):
    """What the spec asked cannot be done (``repeats``: nor on another try)."""

    def __init__(self, message: str, repeats: bool = False) -> None:
        super().__init__(message)
        self.repeats = repeats


def _reserve(addr: str, port: int) -> socket.socket:
    """Reserve a rendezvous port on this host (see :mod:`ringtrain.sockets`)."""
    try:
        return sockets.reserve_rendezvous(addr, port, host=socket.gethostname())
    except ConfigError as exc:
        raise _Refused(str(exc)) from None


def _watch_stdin(agent: _Agent, stdin: IO[bytes]) -> None:
    # Lines after the spec are heartbeats (empty) or, for a resizable job, a worker's
    # next world; end of input means "stop now".
    while line := stdin.readline():
        agent.last_heard = time.monotonic()
        if line.strip():
            try:
                agent.control(json.loads(line))
            except (ValueError, AttributeError, TypeError):
                pass  # not ringrun's (nothing else writes to this pipe)
    agent.stopping.set()


def main() -> int:
    out = sys.stdout.buffer
    agent = _Agent(out)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stopping.set())
    agent.send(b"R " + json.dumps(info()).encode())
    stdin = sys.stdin.buffer
    first = stdin.readline()
    listener = None
    try:
        if first.strip() and "reserve" in (request := json.loads(first)):
            agent.reserve(request["reserve"])
            first = stdin.readline()
        if not first.strip():
            return 0  # ringrun went away before sending a spec (e.g. another host failed)
        spec = json.loads(first)
        agent.heartbeat_timeout = float(spec.get("heartbeat_timeout") or 0)
        if spec.get("stop_grace") is not None:
            agent.grace = max(0.0, float(spec["stop_grace"]))
        agent.last_heard = time.monotonic()
        if spec.get("listen"):
            listener = _reserve(spec["listen"]["addr"], int(spec["listen"]["port"]))
            port = listener.getsockname()[1]
            agent.send(f"L {port}".encode())
            for item in spec["ranks"]:
                item["env"]["MASTER_PORT"] = str(port)
        agent.start(spec, listener)
    except _Refused as exc:
        agent.send(f"{'F' if exc.repeats else 'E'} {exc}".encode())
        agent.stop()
        agent.close_watchdog()
        agent.remove_files()
        return 2
    finally:
        if listener is not None:
            listener.close()  # rank 0 holds its own copy
    threading.Thread(target=_watch_stdin, args=(agent, stdin), daemon=True).start()
    try:
        return agent.watch()
    finally:
        agent.stop()  # what finished ranks left running: their groups, what left them
        agent.close_watchdog()
        agent.remove_files()


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    # os._exit: the stdin watcher thread may sit in a read, and a normal interpreter
    # exit aborts (SIGABRT) when a daemon thread holds stdin's buffer lock.
    os._exit(status)
