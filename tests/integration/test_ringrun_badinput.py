"""Bad input to ringrun: one clear line naming the problem and the fix, a non-zero exit,
no traceback, and no process left behind.

Mistakes caught while parsing run through ``main(argv)`` in-process (it is the only place
that turns errors into exit codes, and nothing has started yet); the ones found while
starting the job (a port in use, an unreachable host, a missing interface) run ringrun
as a real process and scan for survivors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hosts.harness import (
    HERE,
    RINGRUN,
    TestHosts,
    assert_no_orphans,
    env_for,
    new_marker,
    teardown_hosts,
    test_hosts,
)

from ringtrain.launch.cli import main

PY = sys.executable
PROBE = str(HERE / "probe_worker.py")


def _hostfile(tmp: Path, text: str) -> str:
    f = tmp / "hosts.txt"
    f.write_text(text)
    return str(f)


# (id, argv builder, fragment of the message). Each is a distinct mistake.
PARSE_CASES = [
    ("np-zero", lambda t: ["-np", "0", PY, PROBE, "report"], "-np must be >= 1"),
    ("np-not-a-number", lambda t: ["-np", "two", PY], "invalid int value: 'two'"),
    ("np-over-slots", lambda t: ["-np", "9", "-H", "a:4,b:4", PY, PROBE], "more than the 8 slots"),
    ("bad-slot-count", lambda t: ["-np", "2", "-H", "a:two", PY, PROBE], "bad slot count 'two'"),
    ("empty-host-entry", lambda t: ["-np", "2", "-H", "a:1,,b:1", PY, PROBE], "empty entry"),
    ("duplicate-host", lambda t: ["-np", "2", "-H", "a:2,a:2", PY, PROBE], "appears twice"),
    ("this-host-twice", lambda t: ["-np", "2", "-H", "localhost:1,127.0.0.1:1", PY, PROBE],
     "listed more than once"),
    ("hostfile-missing", lambda t: ["-np", "2", "--hostfile", str(t / "nope"), PY, PROBE],
     "cannot read hostfile"),
    ("hostfile-bad-line", lambda t: ["-np", "2", "--hostfile", _hostfile(t, "a slots=4\nb slots=x\n"),
                                     PY, PROBE], "line 2"),
    ("hostfile-empty", lambda t: ["-np", "2", "--hostfile", _hostfile(t, "# none\n\n"), PY, PROBE],
     "lists no hosts"),
    ("hosts-and-hostfile", lambda t: ["-np", "2", "-H", "a:2", "--hostfile", "f", PY],
     "not allowed with argument"),
    ("unknown-flag", lambda t: ["-np", "2", "--bogus", PY, PROBE], "unrecognized arguments: --bogus"),
    ("no-command", lambda t: ["-np", "2"], "no command given"),
    ("command-not-found", lambda t: ["-np", "2", "no-such-command-xyz"], "not found on PATH"),
    ("missing-script", lambda t: ["-np", "2", PY, str(t / "missing_train.py")], "does not exist"),
    ("master-port-range", lambda t: ["-np", "2", "--master-port", "70000", PY, PROBE],
     "not a TCP port"),
    ("ssh-port-range", lambda t: ["-np", "2", "-H", "a:2", "-p", "0", PY, PROBE], "not a TCP port"),
    ("bad-export-name", lambda t: ["-np", "2", "-x", "1BAD", PY, PROBE], "is not a variable name"),
    ("export-unset", lambda t: ["-np", "2", "-x", "RT_SURELY_UNSET_VAR", PY, PROBE], "is not set here"),
    ("identity-missing", lambda t: ["-np", "2", "-H", "a:2", "-i", str(t / "no_key"), PY, PROBE],
     "cannot be read"),
    ("start-timeout-zero", lambda t: ["-np", "2", "--start-timeout", "0", PY, PROBE], "must be > 0"),
    ("negative-restarts", lambda t: ["-np", "2", "--max-restarts", "-1", PY, PROBE], "must be >= 0"),
    ("ssh-option-shape", lambda t: ["-np", "2", "-H", "a:2", "--ssh-option", "foo", PY, PROBE],
     "is not KEY=VALUE"),
    ("output-filename-is-a-file", lambda t: ["-np", "1", "--output-filename", "/etc/passwd", PY, PROBE],
     "/etc/passwd is a file, not a directory"),
    ("output-filename-under-a-file", lambda t: ["-np", "1", "--output-filename",
                                                _hostfile(t, "") + "/logs", PY, PROBE],
     "is a file, so the directory cannot be created"),
    ("output-filename-not-writable", lambda t: ["-np", "1", "--output-filename", "/proc/1/logs",
                                                PY, PROBE], "/proc/1 is not writable"),
    ("np-over-this-hosts-slots", lambda t: ["-np", str(len(os.sched_getaffinity(0)) + 1), PY, PROBE],
     "--oversubscribe to run more ranks than slots"),
    ("local-interface-missing", lambda t: ["-np", "2", "-H", "localhost:1,a:1", "--network-interface",
                                           "nope0", PY, PROBE], "no IPv4 address on this host"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("build,fragment", [(b, f) for _, b, f in PARSE_CASES],
                         ids=[i for i, _, _ in PARSE_CASES])
def test_parse_time_mistakes(build, fragment: str, tmp_path: Path,  # type: ignore[no-untyped-def]
                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(build(tmp_path))
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("ringrun: error: "), err
    assert fragment in err and "Traceback" not in err


def _run(args: list[str], marker: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RINGRUN, *args], capture_output=True, text=True, timeout=timeout,
                          env=env_for(marker))


def _assert_one_line(res: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert res.returncode != 0
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("ringrun: error: "), res.stderr
    assert fragment in res.stderr and "Traceback" not in res.stderr


@pytest.mark.timeout(60)
def test_master_port_in_use() -> None:
    marker = new_marker()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = _run(["-np", "2", "--master-port", str(port), "python", PROBE, "report"], marker)
    _assert_one_line(res, f"--master-port {port} is in use")
    assert "rank=" not in res.stdout  # refused before any worker started
    assert_no_orphans(marker)


@pytest.mark.timeout(60)
def test_missing_script_as_a_process(tmp_path: Path) -> None:
    marker = new_marker()
    res = _run(["-np", "2", "python", str(tmp_path / "train.py")], marker)
    _assert_one_line(res, "does not exist")
    assert_no_orphans(marker)


@pytest.fixture(scope="module")
def hosts() -> Iterator[TestHosts]:
    yield test_hosts(2)
    teardown_hosts()


@pytest.mark.system  # network-namespace hosts
@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra,fragment", [
    (["-H", "10.213.57.11:1,10.213.57.99:1", "--start-timeout", "2"], "10.213.57.99"),
    (["-H", "10.213.57.11:1,10.213.57.12:1", "-p", "2222"], "port 2222: Connection refused"),
    (["-H", "10.213.57.11:1,10.213.57.12:1", "--network-interface", "nope0"],
     "nope0 does not exist on host 10.213.57.11"),
    (["-H", "10.213.57.11:1,10.213.57.12:1", "--ssh-option", "UserKnownHostsFile=/dev/null"],
     "Host key verification failed"),
], ids=["host-unreachable", "ssh-refused", "remote-interface-missing", "unknown-host-key"])
def test_start_time_mistakes_on_hosts(hosts: TestHosts, extra: list[str], fragment: str) -> None:
    marker = new_marker()
    flags = hosts.ssh_flags
    if "--ssh-option" in extra:  # replace the pinned known_hosts with an empty one
        flags = ["-i", flags[1], "--ssh-option", "StrictHostKeyChecking=yes"]
    res = _run([*flags, "-x", "RINGTEST_MARKER", "-np", "2", *extra, "python", PROBE, "report"], marker)
    _assert_one_line(res, fragment)
    assert_no_orphans(marker, remote=True)
