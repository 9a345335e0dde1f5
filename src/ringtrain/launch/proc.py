"""One worker process: start it, copy its output with a rank prefix, stop it for sure.

Every worker runs in its own session (process group), so stopping it also stops the
processes it started (data-loader workers, shells). A worker whose launcher dies is
killed by the kernel (PR_SET_PDEATHSIG), so a SIGKILLed ringrun leaves no orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

__all__ = ["OutputSink", "Worker"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGKILL us when the
    # launcher goes away, whatever the way it dies.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort on non-Linux systems
        pass


class OutputSink:
    """Where worker lines go: the terminal with a ``[rank]`` prefix, or one file per rank."""

    def __init__(self, directory: str | None, prefix: bool = True) -> None:
        self.directory = directory
        self.prefix = prefix
        self._lock = threading.Lock()
        if directory:
            os.makedirs(directory, exist_ok=True)

    def open_for(self, rank: int, attempt: int) -> IO[bytes] | None:
        if not self.directory:
            return None
        name = f"rank.{rank}.log" if attempt == 0 else f"rank.{rank}.attempt{attempt}.log"
        return open(os.path.join(self.directory, name), "ab")

    def write(self, rank: int, line: bytes, file: IO[bytes] | None) -> None:
        if file is not None:
            file.write(line)
            file.flush()
            return
        text = (f"[{rank}] ".encode() if self.prefix else b"") + line
        with self._lock:
            sys.stdout.buffer.write(text)
            sys.stdout.buffer.flush()


class Worker:
    """A started worker process with its output pump."""

    def __init__(
        self,
        rank: int,
        argv: Sequence[str],
        env: dict[str, str],
        sink: OutputSink,
        attempt: int = 0,
        pass_fds: Sequence[int] = (),
        cwd: str | None = None,
        stdin_pipe: bool = False,
    ) -> None:
        self.rank = rank
        self._sink = sink
        self._file = sink.open_for(rank, attempt)
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
            preexec_fn=_die_with_parent,
        )
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            self._sink.write(self.rank, line if line.endswith(b"\n") else line + b"\n", self._file)
        self.proc.stdout.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish_output(self, timeout: float = 2.0) -> None:
        self._pump.join(timeout)
        if self._file is not None:
            self._file.close()
            self._file = None


def stop_all(workers: Sequence[Worker], grace: float = 3.0) -> None:
    """SIGTERM every worker's process group, SIGKILL what is left after ``grace`` seconds."""
    for w in workers:
        if w.poll() is None:
            w.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(w.poll() is None for w in workers):
        time.sleep(0.05)
    for w in workers:
        # Kill the group even if the leader exited: its children may still be running.
        w.signal_group(signal.SIGKILL)
        if w.poll() is None:
            try:
                w.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
        w.finish_output()


__all__ += ["stop_all"]
