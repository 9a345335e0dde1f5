"""The one way ringtrain stops processes it started: ask, wait a grace period, kill.

:func:`stop_sequence` asks every member to stop at once, waits until none is alive or
the grace period is over, and kills what is left, then waits for it. ringrun's workers
and host agents (:mod:`ringtrain.launch.processes`, which adds the job's stray
processes), the loader's worker processes, the planner's calibration ranks and the
doctor's job all stop this way; a member is anything :class:`Stoppable`, and
:class:`SpawnedProcess` / :class:`PlainProcess` make one of a ``multiprocessing.Process``
or a ``subprocess.Popen``. A leaf of the standard library only.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["PlainProcess", "SpawnedProcess", "Stoppable", "stop_sequence"]

#: Seconds a killed process has to be reaped.
REAP_S = 2.0


class Stoppable(Protocol):
    """What :func:`stop_sequence` needs of a process (or of a remote host's processes)."""

    def alive(self) -> bool: ...
    def request_stop(self) -> None: ...
    def force_kill(self) -> None: ...


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
