"""What a job of ringrun starts and stops: its *members* (standard library only: the
host agent imports it). Processes are started and stopped with :mod:`ringtrain.processes`.

- :class:`Rank`: a :class:`~ringtrain.processes.Child` asked to stop with the signal
  the launcher received (:data:`Rank.stop_signal`), as torchrun's agent does: on Ctrl-C a
  script's ``except KeyboardInterrupt:`` (a last checkpoint) runs, as under torchrun.
- :class:`Worker`: one local rank of ringrun, a :class:`Rank` whose output goes to the
  job's output sink. A Worker and a
  :class:`~ringtrain.launch.remote.RemoteHost` (every rank of one remote host) are both
  *members* of a job: they answer ``exits()``, ``exit_time()`` and ``alive()`` and obey
  ``request_stop()`` / ``force_kill()``, which is all :func:`stop_all` and the job's
  watch loop need.
- :func:`stop_marked`: ringtrain's one stop sequence
  (:func:`ringtrain.processes.stop_sequence`) plus what left the children's process
  groups: every process of this host that carries the job's mark. What a worker starts
  outside its group is also ended by the launcher's watchdog
  (:mod:`ringtrain.launch.reaper`), so a SIGKILLed ringrun leaves no orphans at any depth.
"""

from __future__ import annotations

import collections
import os
import signal
import string
from collections.abc import Callable, Sequence
from typing import Protocol

from ringtrain.errors import LaunchError
from ringtrain.launch import reaper
from ringtrain.launch.output import STDERR, STDOUT, OutputSink
from ringtrain.processes import Child, Stoppable, start_failure, start_failure_repeats, stop_sequence

__all__ = ["LOCAL_RANK_MACRO", "Member", "Rank", "StartFailure", "Worker", "stop_all", "stop_marked",
           "substitute_local_rank"]

#: torchrun's one macro (``torch.distributed.elastic.utils.api.macros.local_rank``): in a
#: command's arguments it becomes each rank's local rank (``--local-rank=${local_rank}``).
LOCAL_RANK_MACRO = "${local_rank}"


def substitute_local_rank(command: Sequence[str], local_rank: int) -> tuple[str, ...]:
    """``command`` with ``${local_rank}`` and ``$local_rank`` in its arguments replaced
    by ``local_rank``, exactly as torchrun's agent does (``macros.substitute``:
    ``string.Template(arg).safe_substitute(local_rank=...)`` on every argument, the
    script's path too, so ``$$`` becomes ``$`` there as well). The program,
    ``command[0]``, is left as it is (torchrun's entrypoint: its python, or the program
    of ``--no-python``). Pure."""
    if not command:
        return ()
    value = str(local_rank)
    return (command[0], *(string.Template(arg).safe_substitute(local_rank=value) for arg in command[1:]))


class StartFailure(LaunchError):
    """A rank could not be started (one line: the rank, the reason, the fix).

    ``repeats``: another try would fail the same way (no such program, not executable, a
    bad '#!' line); otherwise it came from the host's state at that moment (no file
    descriptors, memory or processes left) and a restart may get past it."""

    def __init__(self, message: str, repeats: bool) -> None:
        super().__init__(message)
        self.repeats = repeats


class _CutShort:
    """A member whose grace ends early: it counts as gone once ``cut_short()`` is true, so
    :func:`~ringtrain.processes.stop_sequence` stops waiting and SIGKILLs it."""

    def __init__(self, member: Stoppable, cut_short: Callable[[], bool]) -> None:
        self.member, self.cut_short = member, cut_short

    def alive(self) -> bool:
        return self.member.alive() and not self.cut_short()

    def request_stop(self) -> None:
        self.member.request_stop()

    def force_kill(self) -> None:
        self.member.force_kill()


def stop_marked(members: Sequence[Stoppable], grace: float, run_id: str | None = None,
                cut_short: Callable[[], bool] | None = None) -> None:
    """:func:`ringtrain.processes.stop_sequence`; with ``run_id``, what the children started
    outside their process groups (a setsid daemon, a shell's grandchildren) is stopped
    too: SIGTERM once with the rest (never a second one to a group member: its handler
    may count them), SIGKILL at the end, until no process of this host carries the job's
    mark (:func:`ringtrain.launch.reaper.end_job`). Once ``cut_short()`` is true (a second
    Ctrl-C) the rest of the grace is skipped: SIGKILL at once."""
    groups = [m.pid for m in members if isinstance(m, Child)]
    if cut_short is not None:
        members = [_CutShort(m, cut_short) for m in members]
    if not run_id:
        stop_sequence(members, grace)
        return
    stop_sequence(members, grace,
                  after_request=lambda: reaper.signal_job(run_id, signal.SIGTERM, skip_groups=groups),
                  after_kill=lambda: reaper.end_job(run_id))


class Member(Stoppable, Protocol):
    """Something the job starts and stops: one local rank, or all ranks of a remote host."""

    ranks: tuple[int, ...]
    #: The signal :meth:`request_stop` sends (remote hosts pass it on to their agent).
    stop_signal: int

    def exits(self) -> dict[int, int]: ...
    #: ``time.monotonic()`` when ``rank``'s exit was seen (None: not exited), so that a
    #: job names the rank that failed first, not the lowest of those that failed.
    def exit_time(self, rank: int) -> float | None: ...
    def where(self, rank: int) -> str: ...
    def finish_output(self, timeout: float = 2.0) -> None: ...


class Rank(Child):
    """A rank's process, asked to stop with :attr:`stop_signal` (SIGKILL follows after
    the grace, see :func:`ringtrain.processes.stop_sequence`)."""

    #: SIGTERM, or the SIGINT / SIGHUP the launcher got: torchrun's agent passes on the
    #: signal it received (torch/distributed/elastic/agent/server/api.py, ``run``), so a
    #: script written for it may handle Ctrl-C as ``KeyboardInterrupt``.
    stop_signal: int = signal.SIGTERM

    def request_stop(self) -> None:
        # The whole group, even when the leader has exited: what it started may still run.
        try:
            os.killpg(self.proc.pid, self.stop_signal)
        except (ProcessLookupError, PermissionError):
            pass


class Worker(Rank):
    """A local rank of ringrun: a :class:`Rank` whose output goes to the job's sink.

    A command that cannot be started (exec format, permission, no file descriptors or
    memory left) raises :class:`StartFailure`, one line naming the rank (``label``:
    what to call it there, by default ``rank N``), the reason and the fix; the caller
    stops the ranks started before it. ``inherit_stdin``: the process reads ringrun's own
    stdin (rank 0's, see :func:`ringtrain.launch.job.run_fixed`); the others read nothing."""

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
        label: str | None = None,
        inherit_stdin: bool = False,
    ) -> None:
        self.rank = rank
        self.ranks: tuple[int, ...] = (rank,)
        self.host = host
        self._sink = sink
        self._file = sink.open_for(rank, attempt)
        self.tail: collections.deque[bytes] = collections.deque(maxlen=5)
        try:
            super().__init__(argv, env, cwd, pass_fds, inherit_stdin)
        except OSError as exc:  # exec format, permission, out of file descriptors or memory
            sink.discard(self._file)  # its empty log: the rank never ran
            raise StartFailure(start_failure(f"{label or f'rank {rank}'} on {host}", argv, exc),
                               start_failure_repeats(exc)) from None
        try:
            self.pump(self._write, self._write_error)
        except BaseException as exc:
            # Started but unwatched: the job does not know it yet, so end it here.
            self.force_kill()
            sink.close(self._file)
            if isinstance(exc, RuntimeError):  # "can't start new thread"
                raise StartFailure(start_failure(f"{label or f'rank {rank}'}'s output thread", argv, exc),
                                   repeats=False) from None
            raise

    def _write(self, piece: bytes, partial: bool) -> None:
        # The sink never raises (see OutputSink.write): the pump keeps draining.
        self.tail.append(piece)
        self._sink.write(self.rank, piece, self._file, partial, STDOUT)

    def _write_error(self, piece: bytes, partial: bool) -> None:
        self.tail.append(piece)
        self._sink.write(self.rank, piece, self._file, partial, STDERR)

    def exits(self) -> dict[int, int]:
        code = self.poll()
        return {} if code is None else {self.rank: code}

    def exit_time(self, rank: int) -> float | None:
        return self.exited_at

    def where(self, rank: int) -> str:
        return f"pid {self.proc.pid} on {self.host}"

    def finish_output(self, timeout: float = 2.0) -> None:
        self.join_output(timeout)
        self._sink.close(self._file)
        self._file = None


def stop_all(members: Sequence[Member], grace: float = 3.0, run_id: str | None = None,
             signum: int = signal.SIGTERM, cut_short: Callable[[], bool] | None = None) -> None:
    """:func:`stop_marked` for the members of a job, then their output drained.

    ``signum`` asks the ranks to stop (ringrun passes on the SIGINT or SIGHUP it got);
    what left their process groups gets SIGTERM, and SIGKILL follows after ``grace``.

    Remote hosts get end-of-input; their agent stops its workers within its own grace
    (:func:`ringtrain.launch.agent.agent_grace` of ringrun's, sent in the spec) and exits, so ``grace``
    must exceed it for a clean remote stop. With ``run_id``, what the local ranks started
    outside their process groups is stopped before the output is drained: such a process
    may hold a worker's pipe open. ``cut_short``: see :func:`stop_marked`.
    """
    for m in members:
        m.stop_signal = signum
    stop_marked(members, grace, run_id, cut_short)
    for m in members:
        m.finish_output()
