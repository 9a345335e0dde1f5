"""Where the workers' output goes: ringrun's stdout with a ``[rank]`` prefix, or one file
per rank (``--output-filename DIR``), or both (``--output-tee``, as Horovod's
``--output-filename`` does), in bounded pieces, and what happens when it cannot go.

Output is read in pieces of at most :data:`ringtrain.processes.PIECE_BYTES`
(:func:`ringtrain.processes.pieces`): a line is passed on as soon as it ends or the piece
is full, so a worker that prints 200 MB without a newline costs
ringrun one piece of memory, not the line (and its copies). On the terminal with the
prefix each piece of a long line becomes its own prefixed line, so ranks never mix
inside a line; files and ``--no-prefix`` get the bytes exactly as written.

A write that fails (nobody reads stdout any more, ``ringrun ... | head -2``; a full disk
under ``--output-filename``) must neither kill the thread that drains a worker's pipe
(the worker would block on its full pipe and the job would hang) nor go unnoticed: the
sink remembers the first failure in :attr:`OutputSink.failure`, drops what it cannot
write from then on, and the job stops with that one line.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from ringtrain.errors import ConfigError, LaunchError

__all__ = ["OutputFailure", "OutputSink", "check_output_dir"]


#: Exit status for a closed stdout: what a shell reports for a program killed by SIGPIPE
#: (``yes | head -2`` under ``set -o pipefail`` gives 141).
EXIT_BROKEN_PIPE = 128 + 13


@dataclass(frozen=True)
class OutputFailure:
    """Why output could not be written, and the exit status the job ends with."""

    message: str
    exit_code: int


def check_output_dir(path: str) -> None:
    """Refuse an ``--output-filename`` that cannot become a writable directory (pure
    apart from looking at the file system; nothing is created)."""
    probe = os.path.abspath(path)
    if os.path.exists(probe) and not os.path.isdir(probe):
        raise ConfigError(f"--output-filename {path} is a file, not a directory; give a directory "
                          "(created if missing) for the rank.N.log files")
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"--output-filename {path}: {probe} is a file, so the directory cannot "
                          "be created; choose another directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-filename {path}: {probe} is not writable; choose a directory "
                          "you can write to")


class OutputSink:
    """The workers' output: the terminal with a ``[rank]`` prefix, or one file per rank
    (and the terminal too with ``tee``)."""

    def __init__(self, directory: str | None, prefix: bool = True,
                 stream: IO[bytes] | None = None, timestamp: bool = False, tee: bool = False,
                 hide: bytes | None = None) -> None:
        self.directory = directory
        #: A marker whose lines go to the terminal only, never to the files (from the
        #: marker to the end of its line; see :data:`ringtrain.processes.RESULT_MARKER_ENV`).
        self.hide = hide or None
        self.prefix = prefix
        #: With ``directory``: the terminal gets the output too.
        self.tee = tee
        #: Start each line with the local time it was written (Horovod's
        #: ``--prefix-output-with-timestamp``, in its ``time.asctime`` form).
        self.timestamp = timestamp
        self._stream = stream
        self._lock = threading.Lock()  # one writer at a time on the terminal
        self._failure_lock = threading.Lock()
        self._stdout_dead = False
        self._dead_files: set[int] = set()
        self.failure: OutputFailure | None = None
        #: What this sink created (the directory and the folders above it that were
        #: missing, the rank files), so that a job that never ran leaves none of it.
        self._made_dirs: list[str] = []
        self._made_files: list[str] = []

    def _make_directory(self, directory: str) -> None:
        # Created with the first rank's file, not before: a job that fails before any
        # rank starts (an unreachable host) leaves no empty directory behind.
        missing, probe = [], os.path.abspath(directory)
        while not os.path.isdir(probe) and os.path.dirname(probe) != probe:
            missing.append(probe)
            probe = os.path.dirname(probe)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--output-filename {directory}: cannot create the directory "
                              f"({exc.strerror}); choose another directory") from None
        self._made_dirs.extend(missing)  # deepest first

    @property
    def stdout(self) -> IO[bytes]:
        return self._stream if self._stream is not None else sys.stdout.buffer

    def open_for(self, rank: int, attempt: int) -> IO[bytes] | None:
        if not self.directory:
            return None
        if not os.path.isdir(self.directory):
            self._make_directory(self.directory)
        name = f"rank.{rank}.log" if attempt == 0 else f"rank.{rank}.attempt{attempt}.log"
        path = os.path.join(self.directory, name)
        existed = os.path.exists(path)
        try:
            file = open(path, "ab")
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # not the path: the process's limit
                raise LaunchError(f"cannot open {path} for rank {rank}'s output ({exc.strerror}); "
                                  "raise the open-file limit (ulimit -n) or start fewer ranks per "
                                  "host") from None
            raise ConfigError(f"cannot open {path} for rank {rank}'s output ({exc.strerror}); "
                              "check --output-filename") from None
        if not existed:
            self._made_files.append(path)
        return file

    def discard(self, file: IO[bytes] | None) -> None:
        """Close a rank's file whose rank never started; remove it if this sink created it
        and nothing was written (an existing log being appended to stays)."""
        if file is None:
            return
        self.close(file)
        self._remove_if_empty(file.name if isinstance(file.name, str) else "")

    def remove_unused(self) -> None:
        """The job never ran: remove the empty files and directories this sink created
        (``--output-filename`` leaves nothing behind for a job that failed to start)."""
        for path in list(self._made_files):
            self._remove_if_empty(path)
        for folder in self._made_dirs:
            try:
                os.rmdir(folder)  # only when empty: what else is there stays
            except OSError:
                break
        self._made_dirs.clear()

    def _remove_if_empty(self, path: str) -> None:
        if path not in self._made_files:
            return
        try:
            if os.path.getsize(path) == 0:
                os.unlink(path)
                self._made_files.remove(path)
        except OSError:
            pass

    @staticmethod
    def close(file: IO[bytes] | None) -> None:
        """Close a rank's file; a failed final flush was already recorded by write()."""
        if file is None:
            return
        try:
            file.close()
        except (OSError, ValueError):
            pass

    def write(self, rank: int, piece: bytes, file: IO[bytes] | None, partial: bool = False) -> None:
        """Write one piece of rank ``rank``'s output; never raises (see :attr:`failure`)."""
        if file is not None:
            self._write_file(rank, piece, file, partial)
            if not self.tee:
                return
        if self._stdout_dead:
            return  # keep draining the worker's pipe, drop the bytes
        stamp = time.asctime().encode() if self.timestamp else b""
        if self.prefix:
            text = stamp + f"[{rank}] ".encode() + piece
            if not text.endswith((b"\n", b"\r")):  # \r: a progress bar redraws its line
                text += b"\n"  # a piece of a long line: its own line, so ranks never mix
        else:
            text = stamp + (b" " if stamp else b"") + piece
            text = text if partial or text.endswith(b"\n") else text + b"\n"
        with self._lock:
            if self._stdout_dead:
                return
            try:
                self.stdout.write(text)
                self.stdout.flush()
            except (OSError, ValueError) as exc:
                self._stdout_dead = True
                self._fail_stdout(exc)

    def _write_file(self, rank: int, piece: bytes, file: IO[bytes], partial: bool) -> None:
        if rank in self._dead_files:
            return
        if self.hide is not None and (at := piece.find(self.hide)) >= 0:
            # A result line; what precedes the marker is the rank's own (a print
            # without a newline), ended here as hvd.run ends it on the terminal.
            piece, partial = piece[:at], False
            if not piece:
                return
        if not partial and not piece.endswith(b"\n"):
            piece += b"\n"
        if self.timestamp:
            piece = time.asctime().encode() + b" " + piece
        try:
            file.write(piece)
            file.flush()
        except (OSError, ValueError) as exc:
            self._dead_files.add(rank)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._record(OutputFailure(
                f"cannot write rank {rank}'s output to {getattr(file, 'name', '?')} ({reason}); "
                "free space there or choose another --output-filename", 1))

    def _fail_stdout(self, exc: BaseException) -> None:
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            self._record(OutputFailure("stdout is closed (broken pipe): nothing reads the job's "
                                       "output any more", EXIT_BROKEN_PIPE))
            # Point fd 1 at /dev/null so the interpreter's flush at exit does not fail too.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError):
                pass
        else:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._record(OutputFailure(f"cannot write the job's output to stdout ({reason})", 1))

    def _record(self, failure: OutputFailure) -> None:
        with self._failure_lock:
            if self.failure is None:
                self.failure = failure
