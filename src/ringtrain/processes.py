"""How ringtrain runs and stops the processes it starts: one module for ringrun's workers,
its host agent's, the loader's worker processes, the planner's calibration ranks and the
doctor's job. A leaf of the standard library only: the host agent imports it without
torch, and worker-side code (the loader) uses it without the launcher.

- :class:`Child`: a process in a session (process group) of its own, so stopping it
  also stops what it started (data-loader workers, shells); killed by the kernel when
  its parent dies (``PR_SET_PDEATHSIG``, :func:`die_with_parent`); its stdout and its
  stderr, each on a pipe of its own, read by a pump thread each in bounded pieces
  (:func:`pieces`), so a launcher can keep them apart as mpirun and torchrun do; the
  moment it exited noted by a waiter thread (:attr:`Child.exited_at`), so a launcher
  can tell which of several processes failed first.
- :func:`stop_sequence`: the one way to stop processes: ask every member at once, wait
  until none is alive or the grace period is over, kill what is left and reap it. A
  member is anything :class:`Stoppable`: a :class:`Child`, a remote host's agent
  connection (``ringtrain.launch.remote``), or, through :class:`SpawnedProcess` /
  :class:`PlainProcess`, a ``multiprocessing.Process`` or a ``subprocess.Popen``.
  ringrun adds the job's stray processes (``ringtrain.launch.members.stop_marked``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, Protocol

__all__ = ["PIECE_BYTES", "RESULT_MARKER_ENV", "Child", "PlainProcess", "SpawnedProcess", "Stoppable",
           "die_with_parent", "pieces", "start_failure", "start_failure_repeats", "stop_sequence"]

#: The variable that gives ringrun ``hvd.run``'s per-job marker (set by
#: ``ringtrain.horovod.runner``; here, in a leaf both sides import): each rank prints its
#: function's pickled value on lines that start with it, which ``hvd.run`` reads from the
#: terminal stream; the ``--output-filename`` files are the ranks' own output, as
#: Horovod's (whose values travel over another channel).
RESULT_MARKER_ENV = "RINGTRAIN_RUN_TOKEN"

#: Seconds a killed process has to be reaped.
REAP_S = 2.0
_PR_SET_PDEATHSIG = 1

#: Largest piece of output read, sent or written at once. 64 KiB: what a Linux pipe
#: holds, so a worker writing a long line is never more than one pipe ahead of us.
PIECE_BYTES = 64 * 1024


class Stoppable(Protocol):
    """What :func:`stop_sequence` needs of a process (or of a remote host's processes)."""

    def alive(self) -> bool: ...
    def request_stop(self) -> None: ...
    def force_kill(self) -> None: ...


def pieces(stream: IO[bytes]) -> Iterator[tuple[bytes, bool]]:
    """Read a pipe as ``(piece, partial)`` as soon as each piece ends; ``partial`` when
    more of its line follows: the start or middle of a line longer than
    :data:`PIECE_BYTES`, or a progress bar's state ended by a carriage return.

    A piece ends at a newline, or at a carriage return not followed by one: a progress
    bar (tqdm) redraws its line after ``\r`` and writes no newline until it is done, so
    waiting for the newline showed none of it until then (Horovod's launcher also passes
    each ``\r`` on at once). A read that ends inside a line waits up to
    :data:`CR_WAIT_S` for the next byte: a ``\n`` after a ``\r`` there makes the two one
    newline (a ``\r\n`` cut between two reads is not a redrawn line plus an empty one),
    and a line start with nothing after it (a prompt: ``input("name? ")``, pdb's) is a
    partial piece, shown at once as torchrun and mpirun show it."""
    # A bytearray cut from the front (del): slicing each piece off a bytes object copied
    # all that followed it, so a read of 64 KiB of short lines copied ~64 KiB per line.
    buf = bytearray()
    fd = _fileno(stream)
    while True:
        end = _piece_end(buf)
        if 0 < end <= PIECE_BYTES:
            piece = bytes(buf[:end])
            del buf[:end]
            yield piece, piece.endswith(b"\r")
        elif len(buf) >= PIECE_BYTES:
            piece = bytes(buf[:PIECE_BYTES])
            del buf[:PIECE_BYTES]
            yield piece, True  # a long line goes on
        elif buf and not _readable_soon(fd):
            # The start of a line and no byte after it within CR_WAIT_S: a prompt waiting
            # for its answer (input(), pdb), or a progress bar's state after a carriage
            # return: shown now rather than when the line goes on.
            piece = bytes(buf)
            buf.clear()
            yield piece, True
        else:
            more = stream.read1(PIECE_BYTES)  # type: ignore[attr-defined]  # what the pipe has now
            if not more:
                if buf:
                    yield bytes(buf), buf.endswith(b"\r")
                return
            buf += more


#: Seconds a read that ended inside a line waits for the next byte, which tells a
#: ``\r\n`` cut between two reads (one newline) from a progress bar's lone ``\r``, and a
#: line written in quick parts from a prompt (shown at once). The two halves of a ``\r\n`` come microseconds apart; 0.1 s is below what a
#: person watching a progress bar notices.
CR_WAIT_S = 0.1


def _fileno(stream: IO[bytes]) -> int | None:
    """The descriptor under ``stream`` to wait on, or None (an in-memory stream, a fake:
    those are read at once, their bytes are all there)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None


def _readable_soon(fd: int | None) -> bool:
    """Whether more bytes (or the end) arrive on ``fd`` within :data:`CR_WAIT_S`.

    Waiting on the descriptor is right because :func:`pieces` only ever calls
    ``read1(PIECE_BYTES)``, and a BufferedReader whose buffer is empty reads a request
    larger than its buffer straight from the descriptor: nothing is ever left in its
    buffer that ``poll`` could not see. ``poll``, not ``select``: a host agent with many
    ranks may hold descriptors above select's 1024."""
    if fd is None:
        return True
    poller = select.poll()
    try:
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(CR_WAIT_S * 1000))
    except (OSError, ValueError):  # closed under us: let read1 report it
        return True


def _piece_end(buf: bytes | bytearray) -> int:
    """Where the first piece of ``buf`` ends (after its newline or lone carriage return),
    0 when none has ended yet. A carriage return that is the last byte of ``buf`` ends
    nothing yet: its ``\n`` may be in the next read (:func:`pieces` decides)."""
    newline = buf.find(b"\n")
    stop = newline if newline >= 0 else len(buf)
    cr = buf.find(b"\r", 0, stop)
    while cr >= 0 and (cr + 1 == len(buf) or buf[cr + 1:cr + 2] == b"\n"):
        if cr + 1 == len(buf):
            return 0  # the last byte: pending
        cr = buf.find(b"\r", cr + 1, stop)  # \r\n: a newline
    if cr >= 0:
        return cr + 1
    return newline + 1 if newline >= 0 else 0


#: What to do about a process that could not be started, by the error's errno.
_START_FIXES = {
    errno.ENOEXEC: "give a program built for this machine, or a script whose first line is a valid '#!' line",
    errno.EACCES: "check that it is executable (chmod +x) and not on a noexec file system",
    errno.EPERM: "check that it is executable (chmod +x) and not on a noexec file system",
    errno.ENOENT: "check the path, PATH and a script's '#!' interpreter",
    errno.ENOTDIR: "check the path, PATH and a script's '#!' interpreter",
    errno.EMFILE: "raise the open-file limit (ulimit -n) or start fewer ranks per host",
    errno.ENFILE: "the system's open-file table is full; start fewer ranks per host",
    errno.ENOMEM: "free memory on this host or start fewer ranks per host",
    errno.EAGAIN: "raise the process limit (ulimit -u), free memory, or start fewer ranks per host",
    errno.E2BIG: "the command line and environment are too long; shorten them (fewer -x variables)",
}


#: Start failures that come from this host's state at the moment (file descriptors,
#: memory, processes): another try may succeed. Every other one (no such program, not
#: executable, a bad '#!' line, an environment too long) repeats until someone changes
#: the program, the file system or the command line.
_PASSING_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})


def start_failure_repeats(exc: BaseException) -> bool:
    """Whether a process that could not be started (``exc``, the error ``Popen`` or
    ``Thread.start`` raised) would fail the same way on every further try."""
    if isinstance(exc, OSError):
        return exc.errno not in _PASSING_ERRNOS
    return False  # threading's "can't start new thread": out of threads or memory, for now


def start_failure(what: str, argv: Sequence[str], exc: BaseException, missing: str | None = None) -> str:
    """One line for a process that could not be started: ``what`` (e.g. "rank 3"), the
    program, the system's reason and what to do about it (``missing``: the fix when the
    program does not exist)."""
    program = argv[0] if argv else "?"
    if isinstance(exc, OSError):
        reason = exc.strerror or str(exc)
        fix = _START_FIXES.get(exc.errno or 0, f"check {program!r}")
        if exc.errno == errno.ENOENT and os.sep in program and os.path.isfile(program):
            fix = f"{program} exists: the interpreter on its '#!' first line does not; fix that line"
        elif missing and exc.errno == errno.ENOENT:
            fix = missing
    else:  # threading's RuntimeError("can't start new thread"): out of threads or memory
        reason, fix = str(exc), _START_FIXES[errno.EAGAIN]
    return f"cannot start {what} ({program!r}: {reason}); {fix}"


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
    """A started process in its own session whose output two pump threads read (see the
    module docstring). Raises OSError when the command cannot be started."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], cwd: str | None = None,
                 pass_fds: Sequence[int] = (), inherit_stdin: bool = False) -> None:
        self.proc = subprocess.Popen(
            # stdin: our own with ``inherit_stdin`` (a launcher's rank 0), else nothing to read
            list(argv), env=env, cwd=cwd, stdin=None if inherit_stdin else subprocess.DEVNULL,
            # Two pipes: a rank's stderr reaches the launcher's stderr (mpirun, torchrun
            # and Horovod's launcher keep the streams apart: `2> err.log`, `| tee`).
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, pass_fds=tuple(pass_fds),
            preexec_fn=die_with_parent,
        )
        self._pumps: list[threading.Thread] = []
        #: ``time.monotonic()`` when the process was first known to have exited (by the
        #: waiter thread :meth:`pump` starts, else by :meth:`poll`); None while it runs.
        self.exited_at: float | None = None

    @property
    def pid(self) -> int:
        """The process's id, which is also its process group's (it leads its session)."""
        return self.proc.pid

    def pump(self, on_piece: Callable[[bytes, bool], None],
             on_error_piece: Callable[[bytes, bool], None] | None = None) -> None:
        """Hand every piece of stdout to ``on_piece(piece, partial)`` and every piece of
        stderr to ``on_error_piece`` (``on_piece`` too when None), each pipe on a thread
        of its own: the order within each stream is kept, not across the two.

        Neither callback may raise: each thread has to keep draining its pipe whatever
        happens to the output, or the process blocks writing."""
        def copy(stream: IO[bytes] | None, deliver: Callable[[bytes, bool], None]) -> None:
            assert stream is not None
            for piece, partial in pieces(stream):
                deliver(piece, partial)
            stream.close()

        streams = ((self.proc.stdout, on_piece), (self.proc.stderr, on_error_piece or on_piece))
        for stream, deliver in streams:
            pump = threading.Thread(target=copy, args=(stream, deliver), daemon=True)
            pump.start()  # appended once started: join_output never joins an unstarted one
            self._pumps.append(pump)
        # The poll loops that watch a job look every few tens of milliseconds, in a fixed
        # order: two ranks that exit between two looks would be told apart by their
        # rank, not by who went first. The waiter wakes when the process exits.
        threading.Thread(target=self._note_exit, daemon=True).start()

    def _note_exit(self) -> None:
        if self.proc.returncode is None:
            try:
                # WNOWAIT: leave the exit status to Popen, which reaps the process.
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
            except OSError:  # reaped already by poll(), which noted the time
                return
        self._noted(time.monotonic())

    def _noted(self, when: float) -> None:
        if self.exited_at is None or when < self.exited_at:
            self.exited_at = when

    def join_output(self, timeout: float) -> None:
        """Wait (bounded: ``timeout`` in all) until both pipes are drained: its last lines
        come before its exit."""
        deadline = time.monotonic() + timeout
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.exited_at is None:
            self._noted(time.monotonic())
        return code

    def alive(self) -> bool:
        return self.poll() is None

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


def stop_sequence(members: Sequence[Stoppable], grace: float,
                  after_request: Callable[[], object] | None = None,
                  after_kill: Callable[[], object] | None = None) -> None:
    """Ask every member to stop, SIGKILL what is left after ``grace`` seconds.

    ``after_request`` runs once every member was asked (the launcher signals what left
    the members' process groups there); ``after_kill`` once every member was killed.
    """
    for m in members:
        m.request_stop()
    if after_request is not None:
        after_request()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(m.alive() for m in members):
        time.sleep(0.02)
    for m in members:
        m.force_kill()
    if after_kill is not None:
        after_kill()


class SpawnedProcess:
    """A ``multiprocessing.Process`` as a member: SIGTERM, then SIGKILL and join."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    def alive(self) -> bool:
        return bool(self.proc.is_alive())

    def request_stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()

    def force_kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        if self.proc.pid is not None:  # started: reap it (bounded, it was killed)
            self.proc.join(REAP_S)


class PlainProcess:
    """A ``subprocess.Popen`` in its parent's process group: SIGTERM, then SIGKILL."""

    def __init__(self, proc: subprocess.Popen[Any]) -> None:
        self.proc = proc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request_stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def force_kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(REAP_S)
        except subprocess.TimeoutExpired:
            pass
