"""Local worker processes: start one, copy its output with a rank prefix, stop it for sure.

Every worker runs in its own session (process group), so stopping it also stops the
processes it started (data-loader workers, shells). A worker whose launcher dies is
killed by the kernel (PR_SET_PDEATHSIG); what it started itself is ended by the
launcher's watchdog (:mod:`ringtrain.launch.reaper`), so a SIGKILLed ringrun leaves no
orphans at any depth.

A :class:`Worker` (one local rank) and a :class:`~ringtrain.launch.remote.RemoteHost`
(every rank of one remote host) are both *members* of an attempt: they answer
``exits()`` and ``alive()`` and obey ``request_stop()`` / ``force_kill()``, which is
all :func:`stop_all` and the job's watch loop need.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from ringtrain.launch import reaper
from ringtrain.launch.output import OutputSink, pieces

__all__ = ["Member", "Worker", "die_with_parent", "stop_all"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child between fork and exec: SIGKILL us when the launcher goes away."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort on non-Linux systems
        pass


class Member(Protocol):
    """Something the job starts and stops: one local rank, or all ranks of a remote host."""

    ranks: tuple[int, ...]

    def exits(self) -> dict[int, int]: ...
    def alive(self) -> bool: ...
    def where(self, rank: int) -> str: ...
    def request_stop(self) -> None: ...
    def force_kill(self) -> None: ...
    def finish_output(self, timeout: float = 2.0) -> None: ...


class Worker:
    """A started local worker process with its output pump."""

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
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
            preexec_fn=die_with_parent,
        )
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        # Bounded pieces, and a sink that never raises: this thread must keep draining
        # the pipe whatever happens to the output, or the worker blocks writing.
        for piece, partial in pieces(self.proc.stdout):
            self.tail.append(piece)
            self._sink.write(self.rank, piece, self._file, partial)
        self.proc.stdout.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def exits(self) -> dict[int, int]:
        code = self.proc.poll()
        return {} if code is None else {self.rank: code}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def where(self, rank: int) -> str:
        return f"pid {self.proc.pid} on {self.host}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def request_stop(self) -> None:
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)

    def force_kill(self) -> None:
        # Kill the group even if the leader exited: its children may still be running.
        self.signal_group(signal.SIGKILL)
        if self.proc.poll() is None:
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                pass

    def finish_output(self, timeout: float = 2.0) -> None:
        self._pump.join(timeout)
        self._sink.close(self._file)
        self._file = None


def stop_all(members: Sequence[Member], grace: float = 3.0, run_id: str | None = None) -> None:
    """Ask every member to stop, SIGKILL what is left after ``grace`` seconds.

    Remote hosts get end-of-input; their agent stops its workers within its own grace
    (1.5 s) and exits, so ``grace`` must exceed it for a clean remote stop. With
    ``run_id``, what the local ranks started outside their process groups (a setsid
    daemon, a shell's grandchildren) is stopped too, before the output is drained:
    such a process may hold a worker's pipe open.
    """
    for m in members:
        m.request_stop()
    if run_id:
        groups = [m.pid for m in members if isinstance(m, Worker)]
        reaper.signal_job(run_id, signal.SIGTERM, skip_groups=groups)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(m.alive() for m in members):
        time.sleep(0.02)
    for m in members:
        m.force_kill()
    if run_id:
        reaper.end_job(run_id)
    for m in members:
        m.finish_output()
