"""The host agent on its own (no ssh): protocol, exit reports, stop on end of input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts.harness import assert_no_orphans, new_marker

import ringtrain.launch.agent as agent_module

AGENT = str(Path(agent_module.__file__))


def _start(marker: str) -> subprocess.Popen[bytes]:
    # Run exactly as ssh would: a plain script, a clean environment apart from PATH.
    return subprocess.Popen([sys.executable, AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={"PATH": os.environ["PATH"]})


def _spec(marker: str, code: str, ranks: tuple[int, ...] = (0, 1), **extra: object) -> bytes:
    spec = {"cwd": os.getcwd(), "command": [sys.executable, "-c", code],
            "ranks": [{"rank": r, "local_size": len(ranks),
                       "env": {"RINGTEST_MARKER": marker, "MY_RANK": str(r)}} for r in ranks],
            "listen": None}
    spec.update(extra)
    return json.dumps(spec).encode() + b"\n"


def _lines(proc: subprocess.Popen[bytes], until: bytes, limit: float = 20) -> list[bytes]:
    assert proc.stdout is not None
    got = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        got.append(line.rstrip(b"\n"))
        if line.startswith(until):
            break
    return got


@pytest.mark.timeout(30)
def test_agent_reports_ready_output_and_exits() -> None:
    marker = new_marker()
    proc = _start(marker)
    ready = _lines(proc, b"R ")
    assert ready[-1].startswith(b"R ")
    info = json.loads(ready[-1][2:])
    assert "lo" in info["ifaces"] and info["cpus"] >= 1
    code = "import os,sys; print('hello', os.environ['MY_RANK'], os.environ['OMP_NUM_THREADS']); sys.exit(int(os.environ['MY_RANK']) * 3)"
    assert proc.stdin is not None
    proc.stdin.write(_spec(marker, code))
    proc.stdin.flush()
    lines = _lines(proc, b"never")  # stdin stays open, as ringrun keeps it: the agent exits by itself
    threads = str(max(1, info["cpus"] // 2)).encode()
    assert sorted(x for x in lines if x.startswith(b"O ")) == [b"O 0 hello 0 " + threads,
                                                               b"O 1 hello 1 " + threads]
    assert b"X 0 0" in lines and b"X 1 3" in lines
    assert proc.wait(10) == 3
    assert_no_orphans(marker)


@pytest.mark.timeout(30)
def test_end_of_input_stops_every_worker_and_their_children() -> None:
    marker = new_marker()
    proc = _start(marker)
    _lines(proc, b"R ")
    # Each worker starts a child that ignores SIGTERM: the agent must still kill the group.
    code = ("import subprocess,sys,time; subprocess.Popen([sys.executable,'-c',"
            "'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']);"
            "print('up', flush=True); time.sleep(60)")
    assert proc.stdin is not None
    proc.stdin.write(_spec(marker, code))
    proc.stdin.flush()
    seen = 0
    while seen < 2:
        seen += _lines(proc, b"O ")[-1].endswith(b"up")
    start = time.monotonic()
    proc.stdin.close()
    rest = _lines(proc, b"never")
    proc.wait(10)
    assert time.monotonic() - start < 5
    assert {x.split()[1] for x in rest if x.startswith(b"X ")} == {b"0", b"1"}
    assert_no_orphans(marker, within=2)


@pytest.mark.timeout(30)
def test_port_in_use_on_rank0s_host_is_reported() -> None:
    import socket

    marker = new_marker()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = _start(marker)
        _lines(proc, b"R ")
        assert proc.stdin is not None
        proc.stdin.write(_spec(marker, "pass", (0,), listen={"addr": "127.0.0.1", "port": port}))
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=10)
    error = [x for x in out.splitlines() if x.startswith(b"E ")]
    assert error and f"port {port} on 127.0.0.1 is in use".encode() in error[0]
    assert proc.returncode == 2


@pytest.mark.timeout(30)
def test_sigkilled_agent_takes_its_workers_along() -> None:
    marker = new_marker()
    proc = _start(marker)
    _lines(proc, b"R ")
    assert proc.stdin is not None
    proc.stdin.write(_spec(marker, "import time; print('up', flush=True); time.sleep(60)"))
    proc.stdin.flush()
    seen = 0
    while seen < 2:
        seen += _lines(proc, b"O ")[-1].endswith(b"up")
    proc.send_signal(signal.SIGKILL)
    proc.wait(5)
    assert_no_orphans(marker, within=3)


@pytest.mark.timeout(30)
def test_missing_heartbeat_stops_the_ranks() -> None:
    """A network partition closes no connection: without ringrun's heartbeat the agent
    stops its ranks by itself after heartbeat_timeout seconds."""
    marker = new_marker()
    proc = _start(marker)
    _lines(proc, b"R ")
    assert proc.stdin is not None
    proc.stdin.write(_spec(marker, "import time; print('up', flush=True); time.sleep(60)",
                           heartbeat_timeout=1.0))
    proc.stdin.flush()  # and then silence, with stdin still open
    start = time.monotonic()
    rest = _lines(proc, b"never")
    assert proc.wait(10) != 0
    assert time.monotonic() - start < 6
    assert any(x.startswith(b"E no word from ringrun") for x in rest)
    assert_no_orphans(marker, within=2)


@pytest.mark.timeout(30)
def test_missing_working_directory_is_reported(tmp_path: Path) -> None:
    marker = new_marker()
    proc = _start(marker)
    _lines(proc, b"R ")
    assert proc.stdin is not None
    proc.stdin.write(_spec(marker, "pass", cwd=str(tmp_path / "gone")))
    proc.stdin.flush()
    rest = _lines(proc, b"E ")
    assert rest[-1].startswith(b"E working directory") and b"does not exist" in rest[-1]
    assert proc.wait(10) == 2


def _vm_hwm_mib(pid: int) -> float:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(60)
def test_a_long_line_goes_to_ringrun_in_bounded_pieces() -> None:
    """A 50 MiB line without a newline: the agent sends 64 KiB pieces (``P``) then the
    end of the line (``O``), and its own memory stays small (before: one 50 MiB line
    and a copy of it with the header)."""
    marker = new_marker()
    proc = _start(marker)
    _lines(proc, b"R ")
    code = ("import sys, time; b = b'y' * (1 << 20)\nfor _ in range(50): sys.stdout.buffer.write(b)\n"
            "sys.stdout.buffer.write(b'\\n'); print('end', flush=True); time.sleep(30)")
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(_spec(marker, code, (0,)))
    proc.stdin.flush()
    pieces, total = 0, 0
    longest = 0
    while True:
        line = proc.stdout.readline()
        assert line, "the agent ended early"
        longest = max(longest, len(line))
        if line.startswith(b"P 0 "):
            pieces += 1
            total += line.count(b"y")
        elif line.startswith(b"O 0 "):
            total += line.count(b"y")
            if line == b"O 0 end\n":
                break
    peak = _vm_hwm_mib(proc.pid)
    proc.stdin.close()
    proc.wait(10)
    assert total == 50 << 20 and pieces >= (50 << 20) // (64 << 10) - 1
    assert longest <= (64 << 10) + 16
    assert peak < 60, f"the agent peaked at {peak:.0f} MiB"
    assert_no_orphans(marker)


TREE = str(Path(__file__).parent / "scripts" / "spawn_tree.py")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["end-of-input", "sigkill"])
def test_agent_ends_what_its_ranks_started_at_any_depth(how: str) -> None:
    """Each rank starts a loader-like child and a setsid daemon (scripts/spawn_tree.py).
    Closing the agent's input (ringrun gone) or SIGKILLing the agent ends all of them:
    the agent by the job's mark, or its watchdog. Before: the daemons survived both."""
    marker = new_marker()
    proc = _start(marker)
    _lines(proc, b"R ")
    spec = json.loads(_spec(marker, ""))
    spec["command"] = [sys.executable, TREE]
    for item in spec["ranks"]:
        item["env"]["RINGTRAIN_RUN_ID"] = "test" + marker[:8]
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    seen = 0
    while seen < 2:
        seen += _lines(proc, b"O ")[-1].endswith(b"ready")
    if how == "sigkill":
        proc.send_signal(signal.SIGKILL)
    else:
        proc.stdin.close()
    proc.wait(10)
    assert_no_orphans(marker, within=5)
