"""A Ctrl-C while ``hvd.run`` waits reaches horovodrun once per press.

A terminal's Ctrl-C goes to its whole foreground process group. horovodrun ran in the
caller's group, so it got the SIGINT from the terminal and again from ``hvd.run``, which
passes a KeyboardInterrupt on; two SIGINTs are ringrun's "kill at once", so the ranks
were SIGKILLed without the grace their ``except KeyboardInterrupt:`` cleanup has under
Horovod (measured: 4 of 6 presses). horovodrun now runs in a process group of its own
and gets each press once, from ``hvd.run``.

The job here is a stand-in for horovodrun that counts the SIGINTs it gets (``_drive``
runs whatever command it is given), and runner.py is loaded on its own, so nothing
imports torch.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hosts.harness import assert_no_orphans, env_for, new_marker

# Found, not imported: the ringtrain.horovod package imports torch.
RUNNER = Path(importlib.util.find_spec("ringtrain").origin or "").parent / "horovod" / "runner.py"

# Counts SIGINTs; reports, each time, the count and whether its process group is the
# caller's (then a terminal's Ctrl-C reaches it directly); ends after the second.
FAKE_HOROVODRUN = r"""
import os, signal, sys, time
got = []
def on_int(signum, frame):
    got.append(signum)
    same = os.getpgrp() == os.getpgid(os.getppid())
    print(f"sigint {len(got)} same-group {same}", flush=True)
signal.signal(signal.SIGINT, on_int)
print("ready", flush=True)
deadline = time.monotonic() + 30
while len(got) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)  # a late duplicate would be counted here
print(f"total {len(got)}", flush=True)
"""

# The caller: hvd.run's driver on the stand-in; a KeyboardInterrupt ends it.
# Python's own Ctrl-C handler, as in a terminal: a process started in the background by a
# non-interactive shell (CI's runner) inherits SIGINT ignored, and Python then installs none.
CALLER = r"""
import importlib.util, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
spec = importlib.util.spec_from_file_location("runner_alone", sys.argv[1])
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
try:
    runner._drive([sys.executable, "-c", sys.argv[2]], dict(os.environ), "tok")
except KeyboardInterrupt:
    print("caller: KeyboardInterrupt", flush=True)
"""


@pytest.mark.timeout(60)
def test_each_ctrl_c_reaches_horovodrun_once() -> None:
    marker = new_marker()
    proc = subprocess.Popen([sys.executable, "-c", CALLER, str(RUNNER), FAKE_HOROVODRUN],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env_for(marker), start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "ready":
                os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole group
            elif line.startswith("sigint 1"):
                os.killpg(proc.pid, signal.SIGINT)  # a second press
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    assert "sigint 1 same-group False" in lines, lines
    assert "total 2" in lines and "caller: KeyboardInterrupt" in lines, lines  # one each
    assert_no_orphans(marker)
