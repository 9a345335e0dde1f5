"""Where the suite's time goes: a pytest plugin that ``tests/times.py`` switches on.

Loaded by conftest.py when ``RINGTEST_TIMES`` names a file; writes one JSON line per
test with

- ``wall``: seconds from the start of its set-up to the end of its tear-down (a
  module-scoped fixture counts for the first test that needs it);
- ``cpu``: CPU seconds of every process the test ran in and started, read from a
  cgroup the runner put pytest into (``RINGTEST_CGROUP``: the cgroup's CPU counter
  file); processes started by sshd or slurmd inside the test hosts are outside it;
- ``hog``: CPU seconds the busy loop beside the suite got meanwhile (``RINGTEST_HOG_PID``),
  so the cores left to the test can be told from the cores it did not use;
- ``sleep``: seconds the pytest process spent in ``time.sleep`` (polls, fixed waits).

Interpreter starts are counted apart, by ``timing_site/sitecustomize.py``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["TimingPlugin", "read_cpu_seconds"]


def read_cpu_seconds(counter: str) -> float:
    """CPU seconds from a cgroup v1 ``cpuacct.usage`` (ns) or a v2 ``cpu.stat`` (usage_usec)."""
    if not counter:
        return 0.0
    text = Path(counter).read_text()
    if counter.endswith("cpu.stat"):
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        return 0.0
    return int(text) / 1e9


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class TimingPlugin:
    def __init__(self, out: str) -> None:
        self._out = open(out, "a", buffering=1)  # noqa: SIM115 - open for the session
        self._counter = os.environ.get("RINGTEST_CGROUP", "")
        self._hog = int(os.environ.get("RINGTEST_HOG_PID", "0") or 0)
        self._slept = 0.0
        real_sleep = time.sleep

        def sleep(seconds: float) -> None:
            t0 = time.perf_counter()
            try:
                real_sleep(seconds)
            finally:
                self._slept += time.perf_counter() - t0

        time.sleep = sleep  # type: ignore[assignment]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
        wall0, cpu0 = time.perf_counter(), read_cpu_seconds(self._counter)
        hog0 = _process_cpu(self._hog) if self._hog else 0.0
        slept0 = self._slept
        yield
        record = {
            "nodeid": item.nodeid,
            "wall": time.perf_counter() - wall0,
            "cpu": read_cpu_seconds(self._counter) - cpu0,
            "hog": (_process_cpu(self._hog) - hog0) if self._hog else 0.0,
            "sleep": self._slept - slept0,
            "system": item.get_closest_marker("system") is not None,
        }
        self._out.write(json.dumps(record) + "\n")
