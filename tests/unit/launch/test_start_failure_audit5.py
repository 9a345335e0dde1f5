"""A rank, a host connection or a job that cannot start: one error line, the ranks already
running stopped, and no empty ``--output-filename`` directory or logs left behind.

The process-level failures (exec format error, no file descriptors or memory left) are
made with a fake ``subprocess.Popen`` that refuses rank 1 only, so rank 0 really runs
first; one real launch under ``ulimit -n`` checks the same end to end.
"""

from __future__ import annotations

import errno
import io
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker

from ringtrain import processes
from ringtrain.errors import LaunchError
from ringtrain.launch import agent, job
from ringtrain.launch.cli import main
from ringtrain.launch.members import Worker
from ringtrain.launch.output import OutputSink

#: An address no test machine has: ringrun takes it for a remote host.
FAR_HOST = "10.213.99.99"


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringrun: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code,fix", [(errno.ENOEXEC, "'#!'"), (errno.EMFILE, "ulimit -n"),
                                      (errno.ENOMEM, "free memory")])
def test_a_later_rank_that_cannot_start_is_one_line_and_stops_the_ranks_started(
        code: int, fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    marker = new_marker()
    monkeypatch.setenv("RINGTEST_MARKER", marker)
    started: dict[str, int] = {}
    real = subprocess.Popen

    class RefusesRank1(real):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
            rank = (kwargs.get("env") or {}).get("RINGTRAIN_RANK")
            if rank == "1":
                raise OSError(code, os.strerror(code))
            super().__init__(args, *rest, **kwargs)
            if rank is not None:
                started[rank] = self.pid

    monkeypatch.setattr(processes.subprocess, "Popen", RefusesRank1)
    out = tmp_path / "logs" / "run1"
    rc = main(["-np", "2", "--oversubscribe", "--output-filename", str(out), "sleep", "30"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 1
    assert "cannot start rank 1" in line and os.strerror(code) in line and fix in line, line
    assert "0" in started  # rank 0 ran before rank 1 failed ...
    assert_no_orphans(marker)  # ... and was stopped
    assert not (tmp_path / "logs").exists()  # the job never ran: no empty logs or folders


@pytest.mark.timeout(30)
def test_a_real_launch_out_of_file_descriptors_stops_the_ranks_started(tmp_path: Path) -> None:
    # Each local rank holds a pipe (and its log file) open in ringrun, so under a low
    # open-file limit a later rank's start fails after the first ones run.
    marker = new_marker()
    out = tmp_path / "logs"
    res = subprocess.run(
        ["bash", "-c", 'ulimit -n 40 && exec "$@"', "bash", RINGRUN, "-np", "48", "--oversubscribe",
         "--output-filename", str(out), "sleep", "30"],
        env=env_for(marker), capture_output=True, text=True, timeout=60)
    line = _one_error_line(res.stderr)
    assert res.returncode == 1
    found = re.search(r"cannot (start|open \S+ for) rank (\d+)", line)
    assert found and int(found.group(2)) > 0 and "Too many open files" in line, line
    assert "ulimit -n" in line
    assert_no_orphans(marker)
    assert not out.exists()


@pytest.mark.timeout(30)
def test_a_rank_whose_output_thread_cannot_start_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    marker = new_marker()

    def no_thread(self: processes.Child, *on_piece: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(processes.Child, "pump", no_thread)
    with pytest.raises(LaunchError, match="rank 3's output thread.*ulimit -u"):
        Worker(3, ["sleep", "30"], env_for(marker), OutputSink(None))
    assert_no_orphans(marker, within=1.0)  # not running unwatched


@pytest.mark.timeout(30)
def test_ssh_that_cannot_start_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh there
    out = tmp_path / "logs"
    rc = main(["-np", "1", "-H", f"{FAR_HOST}:1", "--output-filename", str(out), "/bin/true"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 1
    assert f"host {FAR_HOST}" in line and "'ssh'" in line and "put it on PATH" in line, line
    assert not out.exists()


@pytest.mark.timeout(30)
def test_an_unreachable_host_leaves_no_output_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    refused = ["sh", "-c", f"echo 'ssh: connect to host {FAR_HOST} port 22: Connection refused' >&2; exit 255"]
    monkeypatch.setattr(job, "ssh_argv", lambda *_args: refused)
    out = tmp_path / "logs" / "run1"
    rc = main(["-np", "2", "-H", f"localhost:1,{FAR_HOST}:1", "--output-filename", str(out), "/bin/true"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 1 and "Connection refused" in line, line
    assert not (tmp_path / "logs").exists()


@pytest.mark.timeout(30)
def test_an_existing_output_directory_and_logs_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refused = ["sh", "-c", "exit 255"]
    monkeypatch.setattr(job, "ssh_argv", lambda *_args: refused)
    (tmp_path / "rank.0.log").write_bytes(b"")  # a previous run's (appended to, never removed)
    assert main(["-np", "1", "-H", f"{FAR_HOST}:1", "--output-filename", str(tmp_path), "/bin/true"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.0.log"]


@pytest.mark.timeout(30)
def test_a_removed_working_directory_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert main(["-np", "1", "/bin/true"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "working directory no longer exists" in line and "cd to" in line, line


def test_a_host_agent_names_the_reason_a_rank_cannot_start(tmp_path: Path) -> None:
    garbage = tmp_path / "train"
    garbage.write_bytes(b"\x7fELF not a program")
    garbage.chmod(0o755)
    spec = {"cwd": str(tmp_path), "command": [str(garbage)],
            "ranks": [{"rank": 5, "local_size": 1, "env": {}}]}
    host = agent._Agent(io.BytesIO())
    with pytest.raises(agent._Refused, match=r"rank 5 .*Exec format error.*'#!'"):
        host.start(spec, None)
    assert not host.procs


def test_a_missing_script_interpreter_is_named(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/no/such/interpreter\n")
    text = processes.start_failure("rank 0", [str(script)], FileNotFoundError(errno.ENOENT, "No such file"))
    assert "'#!' first line" in text and "fix that line" in text  # not "check PATH"


@pytest.mark.timeout(30)
def test_a_resizable_job_that_never_started_leaves_no_output_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.sh"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    out = tmp_path / "logs"
    rc = main(["--min-np", "1", "--max-np", "2", "-H", "localhost:2", "--output-filename", str(out),
               str(script)])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 1 and "'#!' first line" in line, line
    assert not out.exists()
