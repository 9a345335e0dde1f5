"""One remote host, seen from ringrun: an ssh connection to its host agent.

:class:`RemoteHost` starts ``ssh host <agent>``, waits for the agent's ready line, sends
the spec (which ranks, which command, which environment) and from then on turns the
agent's lines into rank output and exit codes (protocol in :mod:`ringtrain.launch.agent`).
When the connection ends before a rank reported its exit, that rank counts as failed
with :data:`HOST_LOST` (the code ssh itself uses for a connection failure).
"""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import threading
import time
from typing import IO, Any

from ringtrain.errors import LaunchError
from ringtrain.launch.output import STDERR, STDOUT, OutputSink, RankFiles
from ringtrain.processes import PIECE_BYTES, die_with_parent, start_failure

__all__ = ["HOST_LOST", "RemoteHost"]

#: Exit code given to the ranks of a host whose connection broke (ssh's own code).
HOST_LOST = 255


class RemoteHost:
    """The ssh connection to one host's agent and the ranks it runs."""

    def __init__(self, host: str, argv: list[str], ranks: tuple[int, ...], sink: OutputSink,
                 attempt: int, env: dict[str, str]) -> None:
        self.host = host
        self.ranks = ranks
        self._argv = argv
        self._env = env
        self._sink = sink
        self._attempt = attempt
        #: Each rank's file under ``--output-filename``, opened with the spec: a host that
        #: never comes up leaves no empty logs behind.
        self._files: dict[int, RankFiles | None] = {}
        self.info: dict[str, Any] | None = None
        self.port: int | None = None
        self.error: str | None = None
        #: The agent could not start a rank, and would not on another try (its ``F`` line).
        self.start_repeats = False
        self.pids: dict[int, int] = {}
        #: Resizable jobs: each worker's reserved rendezvous port, the world it joined last.
        self.reserved: dict[int, int] = {}
        self.joined: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        #: When each rank's exit line arrived (the agent sends them in the order the
        #: ranks exited), and when the connection's output ended (a lost host's ranks).
        self._exit_times: dict[int, float] = {}
        self._ended_at: float | None = None
        #: The signal the agent stops its ranks with (see members.Rank); sent once the
        #: agent runs them (before that, any line would be read as the spec).
        self.stop_signal: int = signal.SIGTERM
        self._running = False
        self.ssh_tail: collections.deque[str] = collections.deque(maxlen=5)
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self.connect()

    # -- connection -----------------------------------------------------------------

    def connect(self) -> None:
        """Start (or restart, after a refused connection) the ssh process."""
        self.ssh_tail.clear()
        self._ended_at = None
        try:
            self.proc = subprocess.Popen(
                self._argv, env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_parent,
            )
        except OSError as exc:  # ssh / srun missing, no file descriptors or memory left
            raise LaunchError(start_failure(
                f"the connection to host {self.host}", self._argv, exc,
                missing=f"install {self._argv[0]} on this host or put it on PATH")) from None
        self._threads = [
            threading.Thread(target=self._read_agent, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._read_ssh, args=(self.proc.stderr,), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_ssh(self, stream: IO[bytes]) -> None:
        for line in iter(lambda: stream.readline(PIECE_BYTES), b""):
            text = line.decode(errors="replace").strip()
            if text:
                self.ssh_tail.append(text)
        stream.close()

    def _read_agent(self, stream: IO[bytes]) -> None:
        # The agent sends output in pieces of at most PIECE_BYTES (plus a short header);
        # the bound also holds for anything else on the connection (a login banner).
        for line in iter(lambda: stream.readline(PIECE_BYTES + 64), b""):
            kind, _, rest = line.partition(b" ")
            if kind in (b"O", b"P", b"T", b"O2", b"P2", b"T2"):  # O2/P2/T2: the rank's stderr
                rank_text, _, text = rest.partition(b" ")
                rank = int(rank_text)
                partial = kind.startswith(b"P")
                if kind[:1] in (b"P", b"T"):  # a piece of a line, or a last one: drop the protocol's newline
                    text = text[:-1] if text.endswith(b"\n") else text
                self._sink.write(rank, text, self._files.get(rank), partial,
                                 STDERR if kind.endswith(b"2") else STDOUT)
            elif kind == b"X":
                rank_text, _, code = rest.partition(b" ")
                with self._lock:
                    self._exits[int(rank_text)] = int(code)
                    self._exit_times[int(rank_text)] = time.monotonic()
            elif kind == b"S":
                rank_text, _, pid = rest.partition(b" ")
                self.pids[int(rank_text)] = int(pid)
            elif kind == b"R":
                self.info = json.loads(rest)
                self._ready.set()
            elif kind == b"L":
                self.port = int(rest)
            elif kind in (b"K", b"J"):
                worker, _, number = rest.partition(b" ")
                (self.reserved if kind == b"K" else self.joined)[int(worker)] = int(number)
            elif kind in (b"E", b"F"):
                self.error = rest.decode(errors="replace").strip()
                self.start_repeats = kind == b"F"
            else:  # not from the agent (a login banner, a shell error): keep it for the report
                self.ssh_tail.append(line.decode(errors="replace").strip())
        self._ended_at = time.monotonic()
        stream.close()

    def ssh_done(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def wait_ready(self, deadline: float) -> bool:
        """Wait for the agent's ready line; False when ssh ended or the deadline passed first."""
        while time.monotonic() < deadline:
            if self._ready.wait(0.02):
                return True
            if self.ssh_done():
                return self._ready.wait(0.2)
        return self._ready.is_set()

    def problem(self) -> str:
        """Why this host is not up, in ssh's or the agent's words."""
        if self.error:
            return self.error
        if self.ssh_tail:
            return self.ssh_tail[-1]
        if self.proc is not None and self.proc.poll() is not None:
            return f"ssh exited with code {self.proc.returncode}"
        return "no answer"

    def send_spec(self, spec: dict[str, Any]) -> None:
        """The spec, or for a resizable job a reservation request or a control message."""
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.closed:
            return
        if "command" in spec and not self._files:  # before the agent can send output
            self._files = {r: self._sink.open_for(r, self._attempt) for r in self.ranks}
        try:
            self.proc.stdin.write(json.dumps(spec).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # the connection broke: exits() reports it
        self._running = self._running or "command" in spec

    def wait_reserved(self, workers: list[int], deadline: float) -> bool:
        """Wait for the agent's ``K`` line of every worker (resizable jobs)."""
        while any(w not in self.reserved for w in workers) and self.error is None:
            if self.ssh_done() or time.monotonic() > deadline:
                time.sleep(0.1)  # let the reader take the last lines
                break
            time.sleep(0.01)
        return all(w in self.reserved for w in workers)

    def heartbeat(self) -> None:
        """Tell the agent ringrun is alive (it stops its ranks after a silence)."""
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def wait_port(self, deadline: float) -> int | None:
        while self.port is None and self.error is None and time.monotonic() < deadline:
            if self.ssh_done():
                time.sleep(0.1)  # let the reader take the last lines
                break
            time.sleep(0.01)
        return self.port

    # -- member interface (see proc.Member) -----------------------------------------

    def exits(self) -> dict[int, int]:
        with self._lock:
            found = dict(self._exits)
        if self.ssh_done() and not self._threads[0].is_alive() and len(found) < len(self.ranks):
            for r in self.ranks:
                found.setdefault(r, HOST_LOST)
        return found

    def exit_time(self, rank: int) -> float | None:
        with self._lock:
            when = self._exit_times.get(rank)
        if when is None and rank in self.exits():  # lost with its host
            when = self._ended_at if self._ended_at is not None else time.monotonic()
        return when

    def lost(self) -> bool:
        """True when the connection ended before every rank reported its exit."""
        with self._lock:
            reported = len(self._exits)
        return self.ssh_done() and reported < len(self.ranks)

    def alive(self) -> bool:
        return not self.ssh_done()

    def where(self, rank: int) -> str:
        pid = self.pids.get(rank)
        return f"pid {pid} on {self.host}" if pid else f"on {self.host}"

    def request_stop(self) -> None:
        # End of input tells the agent to stop its workers (ssh forwards no signals); a
        # signal other than SIGTERM is named first.
        if self.stop_signal != signal.SIGTERM and self._running:
            self.send_spec({"stop_signal": int(self.stop_signal)})
        if self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def force_kill(self) -> None:
        if self.proc is None:
            return
        # Killing ssh closes the connection, which the agent also takes as "stop".
        try:
            self.proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            pass

    def finish_output(self, timeout: float = 2.0) -> None:
        for t in self._threads:
            t.join(timeout)
        for r, f in list(self._files.items()):
            self._sink.close(f)
            self._files[r] = None
