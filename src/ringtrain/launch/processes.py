"""Starting and stopping the job's processes: one definition each, for ringrun, its host
agent and the planner's calibration runs (standard library only: the agent imports it).

- :class:`Child`: a process in a session (process group) of its own, so stopping it
  also stops what it started (data-loader workers, shells); killed by the kernel when its
  parent dies (``PR_SET_PDEATHSIG``); its output (stdout and stderr together) read by a
  pump thread in bounded pieces (:func:`ringtrain.launch.output.pieces`). What it starts
  outside its group is ended by the launcher's watchdog (:mod:`ringtrain.launch.reaper`),
  so a SIGKILLed ringrun leaves no orphans at any depth.
- :func:`stop_marked`: ringtrain's one stop sequence (:func:`ringtrain.stopping.stop_sequence`:
  ask each to stop, SIGTERM to a child's group or end of input to a remote host's
  agent, wait up to a grace period, SIGKILL what is left) with what left the groups:
  every process of this host that carries the job's mark.
- :class:`Worker`: one local rank of ringrun, a :class:`Child` whose output goes to the
  job's output sink. A Worker and a :class:`~ringtrain.launch.remote.RemoteHost` (every
  rank of one remote host) are both *members* of a job: they answer ``exits()`` and
  ``alive()`` and obey ``request_stop()`` / ``force_kill()``, which is all
  :func:`stop_all` and the job's watch loop need.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from ringtrain.launch import reaper
from ringtrain.launch.output import OutputSink, pieces
from ringtrain.stopping import REAP_S, Stoppable, stop_sequence

__all__ = ["Child", "Member", "Worker", "die_with_parent", "stop_all", "stop_marked"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child between fork and exec: SIGKILL us when the launcher goes away."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort on non-Linux systems
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Child:
    """A started process in its own session whose output a pump thread reads (see the
    module docstring). Raises OSError when the command cannot be started."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: str | None = None,
                 pass_fds: Sequence[int] = ()) -> None:
        self.proc = subprocess.Popen(
            list(argv), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=tuple(pass_fds),
            preexec_fn=die_with_parent,
        )
        self._pump: threading.Thread | None = None

    @property
    def pid(self) -> int:
        """The process's id, which is also its process group's (it leads its session)."""
        return self.proc.pid

    def pump(self, on_piece: Callable[[bytes, bool], None]) -> None:
        """Hand every piece of output to ``on_piece(piece, partial)`` on a thread of its own.

        ``on_piece`` must never raise: the thread has to keep draining the pipe whatever
        happens to the output, or the process blocks writing."""
        def copy() -> None:
            assert self.proc.stdout is not None
            for piece, partial in pieces(self.proc.stdout):
                on_piece(piece, partial)
            self.proc.stdout.close()

        self._pump = threading.Thread(target=copy, daemon=True)
        self._pump.start()

    def join_output(self, timeout: float) -> None:
        """Wait (bounded) until the output is drained: its last lines come before its exit."""
        if self._pump is not None:
            self._pump.join(timeout)

    def poll(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request_stop(self) -> None:
        # The whole group, even when the leader has exited: what it started may still run.
        _signal_group(self.proc.pid, signal.SIGTERM)

    def force_kill(self) -> None:
        # Kill the group even if the leader exited: its children may still be running.
        _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(REAP_S)
        except subprocess.TimeoutExpired:
            pass


def stop_marked(members: Sequence[Stoppable], grace: float, run_id: str | None = None) -> None:
    """:func:`ringtrain.stopping.stop_sequence`; with ``run_id``, what the children started
    outside their process groups (a setsid daemon, a shell's grandchildren) is stopped
    too: SIGTERM once with the rest (never a second one to a group member: its handler
    may count them), SIGKILL at the end, until no process of this host carries the job's
    mark (:func:`ringtrain.launch.reaper.end_job`)."""
    if not run_id:
        stop_sequence(members, grace)
        return
    groups = [m.pid for m in members if isinstance(m, Child)]
    stop_sequence(members, grace,
                  after_request=lambda: reaper.signal_job(run_id, signal.SIGTERM, skip_groups=groups),
                  after_kill=lambda: reaper.end_job(run_id))


class Member(Stoppable, Protocol):
    """Something the job starts and stops: one local rank, or all ranks of a remote host."""

    ranks: tuple[int, ...]

    def exits(self) -> dict[int, int]: ...
    def where(self, rank: int) -> str: ...
    def finish_output(self, timeout: float = 2.0) -> None: ...


class Worker(Child):
    """A local rank of ringrun: a :class:`Child` whose output goes to the job's sink."""

    def __init__(
        self,
        rank: int,
        argv: Sequence[str],
        env: dict[str, str],
        sink: OutputSink,
        attempt: int = 0,
        pass_fds: Sequence[int] = (),
        cwd: str | None = None,
        host: str = "localhost",
    ) -> None:
        self.rank = rank
        self.ranks: tuple[int, ...] = (rank,)
        self.host = host
        self._sink = sink
        self._file = sink.open_for(rank, attempt)
        self.tail: collections.deque[bytes] = collections.deque(maxlen=5)
        super().__init__(argv, env, cwd, pass_fds)
        self.pump(self._write)

    def _write(self, piece: bytes, partial: bool) -> None:
        # The sink never raises (see OutputSink.write): the pump keeps draining.
        self.tail.append(piece)
        self._sink.write(self.rank, piece, self._file, partial)

    def exits(self) -> dict[int, int]:
        code = self.proc.poll()
        return {} if code is None else {self.rank: code}

    def where(self, rank: int) -> str:
        return f"pid {self.proc.pid} on {self.host}"

    def finish_output(self, timeout: float = 2.0) -> None:
        self.join_output(timeout)
        self._sink.close(self._file)
        self._file = None


def stop_all(members: Sequence[Member], grace: float = 3.0, run_id: str | None = None) -> None:
    """:func:`stop_marked` for the members of a job, then their output drained.

    Remote hosts get end-of-input; their agent stops its workers within its own grace
    (1.5 s) and exits, so ``grace`` must exceed it for a clean remote stop. With
    ``run_id``, what the local ranks started outside their process groups is stopped
    before the output is drained: such a process may hold a worker's pipe open.
    """
    stop_marked(members, grace, run_id)
    for m in members:
        m.finish_output()
