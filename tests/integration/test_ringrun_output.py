"""Where ringrun's output goes when it cannot be written (issue #18, item 4).

A reader that goes away (``ringrun ... | head -2``) or a full disk under
``--output-filename`` must not kill the output threads and leave the workers blocked on
a full pipe: the job stops with one line naming the problem. A worker's very long line
(no newline for 200 MB) is passed on in pieces, so ringrun's memory does not grow with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker

PY = sys.executable
# Prints numbered lines until stopped: fills any pipe that is not read.
CHATTY = "import itertools\nfor i in itertools.count(): print('line', i, flush=True)"
MIB = 1 << 20
LONG_MIB = 200
# One line of LONG_MIB MiB written in 1 MiB blocks (the worker itself stays small), then
# a short line, then a wait to be stopped.
LONG_LINE = (f"import sys, time\nb = b'x' * {MIB}\n"
             f"for _ in range({LONG_MIB}): sys.stdout.buffer.write(b)\n"
             "sys.stdout.buffer.write(b'\\n'); print('end', flush=True); time.sleep(60)")


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("ringrun: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


@pytest.mark.timeout(60)
def test_closed_stdout_stops_the_job_with_one_line() -> None:
    """Before: the output thread died with BrokenPipeError, the workers blocked writing
    to their full pipes and ringrun never exited."""
    marker = new_marker()
    proc = subprocess.Popen([RINGRUN, "-np", "2", PY, "-c", CHATTY], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env_for(marker))
    try:
        assert proc.stdout is not None and proc.stderr is not None
        head = [proc.stdout.readline() for _ in range(2)]
        assert all("line" in x for x in head), head
        proc.stdout.close()  # `| head -2` exits
        code = proc.wait(timeout=30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert code == 128 + signal.SIGPIPE, err[-3000:]  # as a shell reports `yes | head -2`
    assert "stdout is closed" in _one_error_line(err)
    assert_no_orphans(marker)


@pytest.mark.timeout(60)
def test_full_log_disk_stops_the_job_naming_the_file(tmp_path: Path) -> None:
    """ENOSPC on a rank's log file: one line with the file and the reason, exit 1.
    The log is a link to /dev/full, which fails every write with ENOSPC as a full disk does."""
    marker = new_marker()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank.0.log").symlink_to("/dev/full")
    res = subprocess.run([RINGRUN, "-np", "2", "--output-filename", str(logs), PY, "-c", CHATTY],
                         capture_output=True, text=True, timeout=45, env=env_for(marker))
    line = _one_error_line(res.stderr)
    assert res.returncode == 1
    assert str(logs / "rank.0.log") in line and "No space left on device" in line, line
    assert_no_orphans(marker)


def _vm_hwm_mib(pid: int) -> float:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(120)
def test_a_200mb_line_costs_ringrun_little_memory_and_arrives_whole(tmp_path: Path) -> None:
    """Before: readline() held the whole line, then copies of it with the prefix and the
    newline: ringrun peaked above 400 MiB. Now lines pass in bounded pieces."""
    marker = new_marker()
    out_path = tmp_path / "out.txt"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([RINGRUN, "-np", "1", PY, "-c", LONG_LINE], stdout=out,
                                stderr=subprocess.PIPE, env=env_for(marker))
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and proc.poll() is None:
                with open(out_path, "rb") as f:
                    f.seek(max(0, os.path.getsize(out_path) - 16))
                    if f.read().endswith(b"[0] end\n"):
                        break
                time.sleep(0.2)
            peak = _vm_hwm_mib(proc.pid)
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    data = out_path.read_bytes()
    assert data.endswith(b"[0] end\n"), data[-200:]
    assert data.count(b"x") == LONG_MIB * MIB  # nothing lost
    assert peak < 100, f"ringrun peaked at {peak:.0f} MiB for a {LONG_MIB} MiB line"
    assert_no_orphans(marker)
