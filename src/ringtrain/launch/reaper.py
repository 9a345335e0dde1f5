"""Ending every process of a job, however deep it sits, even after ringrun is SIGKILLed.

Each rank runs in its own process group with ``PR_SET_PDEATHSIG``, but neither reaches
everything a rank starts: ``bash -c "python train.py; ..."`` forks python (no death
signal: it is inherited by no child), a data-loader worker or a daemon may call
``setsid()`` and leave the group, and a SIGKILLed ringrun cannot clean up at all. So:

- every process of a job carries ``RINGTRAIN_RUN_ID=<run id>`` in its environment (the
  launcher sets it for every rank; children inherit it), and :func:`end_job` signals
  the ranks' process groups *and* every process whose environment carries the mark,
  rescanning until none is left (a process may fork while we kill). The same idea as
  Jenkins' process-tree killer, which finds a build's processes by an environment cookie.
- a **watchdog** (this file run as a script, standard library only) is started by
  ringrun, and by each host agent, in its own session with a pipe from its parent. It
  is told each rank's process group; when the pipe reaches end of input without the
  word ``done``, its parent died however it died, and it runs :func:`end_job` itself.

What escapes: a process that drops the mark from its environment (``env -i``) *and*
leaves its process group. Reading another user's ``/proc/PID/environ`` is not allowed,
so the job's processes must run as the launcher's user (they do).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

if not __package__:
    # Run as the watchdog script: import this tree's ringtrain as a package (its own
    # folder, first on the path, goes: its modules would shadow ringtrain's names).
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from ringtrain.processes import stop_sequence  # noqa: E402 - standard library only, as this module

__all__ = ["MARK", "Watchdog", "end_job", "marked_processes", "signal_job"]

#: The environment variable whose value names the job (set by ringrun for every rank).
MARK = "RINGTRAIN_RUN_ID"

#: Seconds between SIGTERM and SIGKILL when the watchdog ends an orphaned job.
WATCHDOG_GRACE_S = 1.0


def _net_namespace(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def marked_processes(run_id: str) -> list[int]:
    """Live processes (not zombies) of this host whose environment carries
    ``RINGTRAIN_RUN_ID=run_id``.

    "This host" is this network namespace: hosts that share one kernel (containers, the
    test suite's namespace hosts) each end their own processes, through their own agent.
    """
    needle = f"{MARK}={run_id}".encode()
    me = os.getpid()
    here = _net_namespace("self")
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
            if needle not in environ.split(b"\0"):
                continue
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if stat.rpartition(")")[2].split()[0] != "Z" and _net_namespace(entry.name) == here:
            found.append(int(entry.name))
    return found


def _signal(pgids: Iterable[int], pids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_job(run_id: str, sig: int, skip_groups: Iterable[int] = ()) -> None:
    """Send ``sig`` once to every marked process of this host outside ``skip_groups``
    (groups the caller signals itself: a process must not get its SIGTERM twice, its
    handler may count them)."""
    skip = set(skip_groups)
    pids = []
    for pid in marked_processes(run_id):
        try:
            if os.getpgid(pid) in skip:
                continue
        except ProcessLookupError:
            continue
        pids.append(pid)
    _signal((), pids, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class _JobRemains:
    """Every process of the job on this host: the ranks' process groups and whatever
    carries the job's mark, rescanned on each look (a process may fork meanwhile)."""

    def __init__(self, run_id: str | None, pgids: Iterable[int], deadline_s: float) -> None:
        self.run_id, self.groups, self.deadline_s = run_id, list(pgids), deadline_s
        self.left: list[int] = []

    def _marked(self) -> list[int]:
        return marked_processes(self.run_id) if self.run_id else []

    def alive(self) -> bool:
        return bool(self._marked()) or any(_group_alive(g) for g in self.groups)

    def request_stop(self) -> None:
        _signal(self.groups, self._marked(), signal.SIGTERM)

    def force_kill(self) -> None:
        until = time.monotonic() + self.deadline_s
        marked = self._marked()
        if not marked and not any(_group_alive(g) for g in self.groups):
            return  # all gone within the grace: nothing to kill
        while True:
            _signal(self.groups, marked, signal.SIGKILL)
            time.sleep(0.02)
            # Rescan: a process may have forked between our scan and its SIGKILL.
            marked = self._marked()
            if not marked or time.monotonic() > until:
                self.left = marked
                return


def end_job(run_id: str | None, pgids: Iterable[int] = (), grace: float = 0.0,
            deadline_s: float = 3.0) -> list[int]:
    """SIGTERM the process groups and the marked processes, SIGKILL what is left after
    ``grace`` seconds (:func:`ringtrain.processes.stop_sequence`; none: SIGKILL at once),
    until nothing is left or ``deadline_s`` passes; returns the pids still found
    (normally none)."""
    remains = _JobRemains(run_id, pgids, deadline_s)
    if grace > 0:
        stop_sequence([remains], grace)
    else:
        remains.force_kill()
    return remains.left


class Watchdog:
    """The parent's side of the watchdog process: tell it each rank's process group."""

    def __init__(self, run_id: str, python: str = sys.executable) -> None:
        self.run_id = run_id
        self.proc: subprocess.Popen[bytes] | None
        try:
            self.proc = subprocess.Popen(
                [python, str(Path(__file__).resolve()), run_id], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                # Its own session: a signal to the launcher's process group (Ctrl-C in a
                # terminal, kill -9 -PGID) must not take the watchdog along.
                start_new_session=True, close_fds=True,
            )
        except OSError:
            self.proc = None  # best effort: the launcher still cleans up while it lives

    def watch_group(self, pgid: int) -> None:
        self._say(f"{pgid}\n")

    def close(self) -> None:
        """The parent cleaned up itself: the watchdog may exit without acting."""
        self._say("done\n")
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _say(self, text: str) -> None:
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(text.encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass


def _watch(run_id: str) -> int:
    # Ignore the signals a terminal or a group kill sends: this process exists to outlive
    # its parent by the second it takes to clean up.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    groups: list[int] = []
    for line in sys.stdin.buffer:
        word = line.strip()
        if word == b"done":
            return 0
        if word.isdigit():
            groups.append(int(word))
    end_job(run_id, groups, grace=WATCHDOG_GRACE_S)  # the parent died without saying done
    return 0


if __name__ == "__main__":
    sys.exit(_watch(sys.argv[1]))
