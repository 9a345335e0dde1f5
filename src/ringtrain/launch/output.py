"""Where the workers' output goes: a rank's stdout to ringrun's stdout and its stderr to
ringrun's stderr (as mpirun, torchrun and Horovod's launcher keep them), each line with a
``[rank]`` prefix; or files (``--output-filename DIR``: ``DIR/rank.N.log`` with both
streams, or in Horovod's layout ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr``,
:data:`LAYOUTS`); or both (``--output-tee``, as Horovod's ``--output-filename`` does), in
bounded pieces, and what happens when it cannot go.

Output is read in pieces of at most :data:`ringtrain.processes.PIECE_BYTES`
(:func:`ringtrain.processes.pieces`): a line is passed on as soon as it ends or the piece
is full, so a worker that prints 200 MB without a newline costs
ringrun one piece of memory, not the line (and its copies). On the terminal with the
prefix each piece of a long line becomes its own prefixed line, so ranks never mix
inside a line; files and ``--no-prefix`` get the bytes exactly as written.

A write that fails (nobody reads stdout or stderr any more, ``ringrun ... | head -2``; a full disk
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

__all__ = ["LAYOUTS", "STDERR", "STDOUT", "OutputFailure", "OutputSink", "RankFiles", "check_output_dir",
           "padded_rank"]

#: The stream a piece of a rank's output came from (its file descriptor).
STDOUT, STDERR = 1, 2

#: ``--output-layout``: "log" is ``DIR/rank.N.log`` (``rank.N.attemptK.log`` after a
#: restart), the two streams in one file, appended to; "horovod" is Horovod's Gloo
#: launcher's (horovod/runner/gloo_run.py): ``DIR/rank.N/stdout`` and
#: ``DIR/rank.N/stderr``, N zero-padded to the width of the largest rank, each file
#: written afresh (``rank.N.attemptK/`` after a restart).
LAYOUTS = ("log", "horovod")


#: Exit status for a closed stdout: what a shell reports for a program killed by SIGPIPE
#: (``yes | head -2`` under ``set -o pipefail`` gives 141).
EXIT_BROKEN_PIPE = 128 + 13


@dataclass(frozen=True)
class OutputFailure:
    """Why output could not be written, and the exit status the job ends with."""

    message: str
    exit_code: int


def padded_rank(rank: int, size: int) -> str:
    """``rank`` zero-padded to the width of ``size - 1``, as Horovod names its rank
    folders (``_pad_rank``: ``rank.07`` of 12); a size of 1 or less is one digit (where
    Horovod's ``log10(0)`` fails)."""
    return str(rank).zfill(len(str(max(size - 1, 0))))


@dataclass(frozen=True)
class RankFiles:
    """One rank's ``--output-filename`` files: ``out`` takes its stdout, ``err`` its
    stderr (the same file in the "log" layout)."""

    out: IO[bytes]
    err: IO[bytes]

    def of(self, stream: int) -> IO[bytes]:
        return self.err if stream == STDERR else self.out

    def all(self) -> tuple[IO[bytes], ...]:
        return (self.out,) if self.out is self.err else (self.out, self.err)


def check_output_dir(path: str) -> None:
    """Refuse an ``--output-filename`` that cannot become a writable directory (pure
    apart from looking at the file system; nothing is created)."""
    probe = os.path.abspath(path)
    if os.path.exists(probe) and not os.path.isdir(probe):
        raise ConfigError(f"--output-filename {path} is a file, not a directory; give a directory "
                          "(created if missing) for the ranks' files")
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"--output-filename {path}: {probe} is a file, so the directory cannot "
                          "be created; choose another directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--output-filename {path}: {probe} is not writable; choose a directory "
                          "you can write to")


class OutputSink:
    """The workers' output: the terminal with a ``[rank]`` prefix (a rank's stderr on
    ours), or the rank's files (and the terminal too with ``tee``).

    ``size``: the number of ranks, which pads the rank in the "horovod" layout's names;
    ``stream``/``err_stream``: the terminal's stdout and stderr (ours by default)."""

    def __init__(self, directory: str | None, prefix: bool = True,
                 stream: IO[bytes] | None = None, timestamp: bool = False, tee: bool = False,
                 hide: bytes | None = None, layout: str = "log", size: int = 1,
                 err_stream: IO[bytes] | None = None) -> None:
        if layout not in LAYOUTS:
            raise ConfigError(f"--output-layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        self.directory = directory
        self.layout = layout
        self.size = size
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
        self._err_stream = err_stream
        # One writer at a time on the terminal, both streams: when they are one terminal
        # (or `2>&1`), a stdout line and a stderr line never mix.
        self._lock = threading.Lock()
        self._failure_lock = threading.Lock()
        self._dead_streams: set[int] = set()
        self._dead_files: set[IO[bytes]] = set()
        #: The streams (a rank's stream to a file or to an unprefixed terminal) whose last
        #: piece ended inside a line: the next one carries no time stamp.
        self._mid_line: set[object] = set()
        #: The rank whose line is open on the prefixed terminal, per stream: a piece that
        #: came before the rest of its line (a prompt, a line written in parts) is shown at
        #: once, and the same rank's next piece goes on after it without a prefix.
        self._open_line: dict[int, int] = {}
        self.failure: OutputFailure | None = None
        #: What this sink created (the directory and the folders above it that were
        #: missing, the rank files and, in the "horovod" layout, the rank folders), so
        #: that a job that never ran leaves none of it.
        self._made_dirs: list[str] = []
        self._made_files: list[str] = []
        self._made_rank_dirs: list[str] = []

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

    @property
    def stderr(self) -> IO[bytes]:
        return self._err_stream if self._err_stream is not None else sys.stderr.buffer

    def open_for(self, rank: int, attempt: int) -> RankFiles | None:
        """Open rank ``rank``'s files (None without ``--output-filename``)."""
        if not self.directory:
            return None
        if not os.path.isdir(self.directory):
            self._make_directory(self.directory)
        if self.layout == "log":
            name = f"rank.{rank}.log" if attempt == 0 else f"rank.{rank}.attempt{attempt}.log"
            file = self._open(os.path.join(self.directory, name), rank, "ab")
            return RankFiles(file, file)
        name = f"rank.{padded_rank(rank, self.size)}" + (f".attempt{attempt}" if attempt else "")
        folder = os.path.join(self.directory, name)
        if not os.path.isdir(folder):
            try:
                os.mkdir(folder)
            except OSError as exc:
                raise ConfigError(f"--output-filename {self.directory}: cannot create {folder} for "
                                  f"rank {rank}'s output ({exc.strerror}); choose another "
                                  "directory") from None
            self._made_rank_dirs.append(folder)
        # "wb": Horovod opens them with "w", so a second run in DIR starts them afresh.
        out = self._open(os.path.join(folder, "stdout"), rank, "wb")
        try:
            err = self._open(os.path.join(folder, "stderr"), rank, "wb")
        except BaseException:
            self.discard(RankFiles(out, out))
            raise
        return RankFiles(out, err)

    def _open(self, path: str, rank: int, mode: str) -> IO[bytes]:
        existed = os.path.exists(path)
        try:
            file = open(path, mode)
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

    def discard(self, files: RankFiles | None) -> None:
        """Close the files of a rank that never started; remove those this sink created
        and nothing was written to (an existing log being appended to stays)."""
        if files is None:
            return
        self.close(files)
        for file in files.all():
            self._remove_if_empty(file.name if isinstance(file.name, str) else "")
        self._remove_rank_dirs()

    def remove_unused(self) -> None:
        """The job never ran: remove the empty files and directories this sink created
        (``--output-filename`` leaves nothing behind for a job that failed to start)."""
        for path in list(self._made_files):
            self._remove_if_empty(path)
        self._remove_rank_dirs()
        for folder in self._made_dirs:
            try:
                os.rmdir(folder)  # only when empty: what else is there stays
            except OSError:
                break
        self._made_dirs.clear()

    def _remove_rank_dirs(self) -> None:
        for folder in list(self._made_rank_dirs):
            try:
                os.rmdir(folder)  # only when empty
                self._made_rank_dirs.remove(folder)
            except OSError:
                pass

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
    def close(files: RankFiles | None) -> None:
        """Close a rank's files; a failed final flush was already recorded by write()."""
        if files is None:
            return
        for file in files.all():
            try:
                file.close()
            except (OSError, ValueError):
                pass

    def write(self, rank: int, piece: bytes, files: RankFiles | None, partial: bool = False,
              stream: int = STDOUT) -> None:
        """Write one piece of rank ``rank``'s ``stream`` (:data:`STDOUT` or
        :data:`STDERR`); never raises (see :attr:`failure`)."""
        if files is not None:
            self._write_file(rank, piece, files.of(stream), partial, stream)
            if not self.tee:
                return
        if stream in self._dead_streams:
            return  # keep draining the worker's pipe, drop the bytes
        if not self.prefix:
            # The bytes as written (a last piece without a newline too, as a rank's own
            # terminal under mpirun or torchrun shows it).
            text = self._stamped((rank, stream), piece, partial)
        terminal = self.stderr if stream == STDERR else self.stdout
        with self._lock:
            if stream in self._dead_streams:
                return
            if self.prefix:
                text = self._prefixed(rank, piece, partial, stream)
            try:
                terminal.write(text)
                terminal.flush()
            except (OSError, ValueError) as exc:
                self._dead_streams.add(stream)
                self._fail_terminal(exc, terminal, "stderr" if stream == STDERR else "stdout")

    def _prefixed(self, rank: int, piece: bytes, partial: bool, stream: int) -> bytes:
        """``piece`` for the prefixed terminal (under the lock): ``[rank] `` where it starts
        a line; a piece of a line that goes on (a prompt waiting for its answer, a line
        written in parts) leaves the line open, and the same rank's next piece continues
        it. Another rank's piece ends the open line first, so ranks never share a line; a
        rank's last piece without a newline ends its line."""
        open_rank = self._open_line.pop(stream, None)
        if open_rank == rank:
            text = piece
        else:
            stamp = time.asctime().encode() if self.timestamp else b""
            text = (b"\n" if open_rank is not None else b"") + stamp + f"[{rank}] ".encode() + piece
        if not piece.endswith((b"\n", b"\r")):  # \r: a progress bar redraws its line
            if partial:
                self._open_line[stream] = rank
            else:
                text += b"\n"
        return text

    def _write_file(self, rank: int, piece: bytes, file: IO[bytes], partial: bool, stream: int) -> None:
        if file in self._dead_files:
            return
        if self.hide is not None and (at := piece.find(self.hide)) >= 0:
            # A result line; what precedes the marker is the rank's own (a print
            # without a newline), ended here as hvd.run ends it on the terminal.
            piece, partial = piece[:at], False
            if not piece:
                return
            piece += b"\n"
        # Otherwise the bytes exactly as the rank wrote them: a last piece without a
        # newline stays without one, as in torchrun's --redirects files and mpirun's
        # --output-filename ones.
        piece = self._stamped((file, stream), piece, partial)  # one file may take both streams
        try:
            file.write(piece)
            file.flush()
        except (OSError, ValueError) as exc:
            self._dead_files.add(file)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._record(OutputFailure(
                f"cannot write rank {rank}'s output to {getattr(file, 'name', '?')} ({reason}); "
                "free space there or choose another --output-filename", 1))

    def _stamped(self, where: object, piece: bytes, partial: bool) -> bytes:
        """``piece`` with ``--timestamp-output``'s time in front where it starts a line
        (Horovod's ``prefix_connection`` stamps each line after a newline or carriage
        return), never inside a line longer than a piece."""
        at_start = where not in self._mid_line
        if partial and not piece.endswith(b"\r"):
            self._mid_line.add(where)
        else:
            self._mid_line.discard(where)
        if not self.timestamp or not at_start:
            return piece
        return time.asctime().encode() + b" " + piece

    def _fail_terminal(self, exc: BaseException, terminal: IO[bytes], name: str) -> None:
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            self._record(OutputFailure(f"{name} is closed (broken pipe): nothing reads the job's "
                                       "output any more", EXIT_BROKEN_PIPE))
            # Point the descriptor at /dev/null so the interpreter's flush at exit does not fail too.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, terminal.fileno())
                os.close(devnull)
            except (OSError, ValueError):
                pass
        else:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._record(OutputFailure(f"cannot write the job's output to {name} ({reason})", 1))

    def _record(self, failure: OutputFailure) -> None:
        with self._failure_lock:
            if self.failure is None:
                self.failure = failure
