"""Which hosts a resizable job may use now: a fixed list, or a host discovery script.

Horovod's contract for ``--host-discovery-script``: an executable that prints the hosts
available now, one ``host:slots`` line each (``host`` alone: one slot), and exits 0.
ringrun runs it every :data:`DISCOVER_EVERY_S` seconds on a thread of its own, so a
slow script never holds up the watch loop; a failing one (non-zero exit, a timeout,
unparsable output) keeps the last good answer and is reported once per new failure.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable

from ringtrain.errors import ConfigError
from ringtrain.launch.hosts import Host, parse_hosts

__all__ = ["DISCOVER_EVERY_S", "Discovery", "parse_discovered", "run_script"]

#: Seconds between two runs of the discovery script (Horovod polls about once a second).
DISCOVER_EVERY_S = 1.0
#: A script that takes longer than this is stopped and its answer ignored.
SCRIPT_TIMEOUT_S = 30.0


def parse_discovered(text: str, where: str = "the host discovery script", slots: int = 1) -> list[Host]:
    """``host:slots`` lines -> hosts (blank lines and ``#`` comments ignored; a ``host``
    without slots has ``slots``, ``--slots-per-host``; pure)."""
    entries = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    entries = [e if ":" in e else f"{e}:{slots}" for e in entries if e]
    if not entries:
        return []
    try:
        return parse_hosts(",".join(entries))
    except ConfigError as exc:
        raise ConfigError(f"{where} printed something that is not 'host:slots' lines: {exc}") from None


def run_script(script: str, timeout: float = SCRIPT_TIMEOUT_S, slots: int = 1) -> list[Host]:
    """Run the discovery script once; its hosts, or ConfigError saying why not."""
    try:
        res = subprocess.run([script], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise ConfigError(f"cannot run --host-discovery-script {script}: {exc.strerror}; "
                          "it must be an executable file") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--host-discovery-script {script} did not finish within "
                          f"{timeout:g} s") from None
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise ConfigError(f"--host-discovery-script {script} exited with code {res.returncode} ({last})")
    return parse_discovered(res.stdout, f"--host-discovery-script {script}", slots)


class Discovery:
    """The hosts available now: ``fixed`` hosts, or the script's latest good answer."""

    def __init__(self, fixed: list[Host] | None = None, script: str | None = None,
                 every: float = DISCOVER_EVERY_S, say: Callable[[str], None] = lambda _m: None,
                 slots: int = 1) -> None:
        self._fixed = list(fixed or [])
        self._slots = slots
        self._script = script
        self._every = every
        self._say = say
        self._lock = threading.Lock()
        self._latest: list[Host] = list(self._fixed)
        self._rounds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def first(self) -> list[Host]:
        """The hosts to start with (runs the script once, here; errors are the caller's)."""
        if self._script is not None:
            hosts = run_script(self._script, slots=self._slots)
            with self._lock:
                self._latest = hosts
                self._rounds = 1
        return self.hosts()

    def start(self) -> None:
        if self._script is not None and self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="ringrun-discovery", daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        assert self._script is not None
        problem = ""
        while not self._stop.wait(self._every):
            try:
                hosts = run_script(self._script, slots=self._slots)
            except ConfigError as exc:
                if str(exc) != problem:
                    self._say(f"warning: {exc}; keeping the last hosts it reported")
                    problem = str(exc)
                continue
            problem = ""
            with self._lock:
                self._latest = hosts
                self._rounds += 1

    def hosts(self) -> list[Host]:
        with self._lock:
            return list(self._latest)

    def rounds(self) -> int:
        """How many answers have been taken (a fixed list: 0, it never changes)."""
        with self._lock:
            return self._rounds

    def close(self) -> None:
        self._stop.set()
