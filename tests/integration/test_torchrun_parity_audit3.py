"""ringrun passes on the signal it got, as torchrun's agent does: a script written for
torchrun that saves a last checkpoint in ``except KeyboardInterrupt:`` does so on Ctrl-C
under ringrun too (before, its ranks got SIGTERM and died without saving)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts.harness import BIN, assert_no_orphans, env_for, new_marker

import ringtrain.launch.agent as agent_module
from ringtrain.launch.members import stop_all
from ringtrain.launch.output import OutputSink
from ringtrain.launch.remote import RemoteHost

# No torch: the launcher's side is what is tested, and it is ready at once.
SCRIPT = ("import os, sys, time\n"
          "print('ready', flush=True)\n"
          "try:\n"
          "    time.sleep(60)\n"
          "except KeyboardInterrupt:\n"
          "    print('rank', os.environ['RANK'], 'saved its checkpoint', flush=True)\n")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ranks_get_the_signal_ringrun_got(sig: signal.Signals, code: int) -> None:
    marker = new_marker()
    proc = subprocess.Popen([str(BIN / "ringrun"), "-np", "2", sys.executable, "-c", SCRIPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(marker))
    assert proc.stdout is not None
    ready, deadline = 0, time.monotonic() + 20
    while ready < 2 and time.monotonic() < deadline:
        ready += proc.stdout.readline().rstrip().endswith("ready")
    assert ready == 2
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == code, err
    saved = sorted(line for line in out.splitlines() if "saved" in line)
    if sig == signal.SIGINT:  # as under torchrun, which sends its workers the SIGINT it got
        assert saved == ["[0] rank 0 saved its checkpoint", "[1] rank 1 saved its checkpoint"], out + err
    else:  # SIGTERM stays SIGTERM: no KeyboardInterrupt
        assert saved == [], out
    assert_no_orphans(marker, within=1.0)


@pytest.mark.timeout(30)
def test_a_remote_hosts_agent_passes_the_signal_on(tmp_path: Path) -> None:
    # The agent run as ssh would run it, without ssh: RemoteHost only needs its argv.
    marker = new_marker()
    out = tmp_path / "out.log"
    with out.open("wb") as stream:
        sink = OutputSink(None, prefix=True, stream=stream)
        host = RemoteHost("h1", [sys.executable, agent_module.__file__], (0,), sink, 0,
                          env_for(marker))
        try:
            assert host.wait_ready(time.monotonic() + 20), host.problem()
            host.send_spec({"cwd": str(Path.cwd()), "command": [sys.executable, "-c", SCRIPT],
                            "ranks": [{"rank": 0, "local_size": 1,
                                       "env": {"RINGTEST_MARKER": marker, "RANK": "0"}}],
                            "listen": None})
            deadline = time.monotonic() + 20
            while b"ready" not in out.read_bytes() and time.monotonic() < deadline:
                time.sleep(0.05)
            stop_all([host], grace=2.5, signum=signal.SIGINT)
        finally:
            stop_all([host], grace=0.5)
    text = out.read_text()
    assert "[0] rank 0 saved its checkpoint" in text, text
    assert_no_orphans(marker, within=1.0)


def test_a_stop_signal_before_the_spec_is_not_sent() -> None:
    # Before the spec the agent would read the line as the spec.
    sent: list[bytes] = []

    class Pipe:
        closed = False

        def write(self, data: bytes) -> None:
            sent.append(data)

        def flush(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    host = RemoteHost.__new__(RemoteHost)
    host.proc = type("P", (), {"stdin": Pipe()})()  # type: ignore[assignment]
    host.stop_signal, host._running = signal.SIGINT, False
    host.request_stop()
    assert sent == []
    host.proc.stdin = Pipe()  # type: ignore[union-attr]
    host._running = True
    host.request_stop()
    assert [json.loads(s) for s in sent] == [{"stop_signal": int(signal.SIGINT)}]
