"""Which rank a failed job names, and what a rank that cannot start does to a restart.

- The failure line names the rank whose exit was seen first (torchrun's "root cause"),
  not the lowest rank among those that failed by the time ringrun looked.
- A rank that cannot start for a reason that may pass (no file descriptors, memory or
  processes left) is a failed attempt while restarts remain; one that would fail the
  same way again (no such program, not executable, a bad '#!') ends the job at once,
  on any attempt, local or remote.
- A resizable job's start failure names the rank (the worker's number is not it), stops
  the new workers already started, and on a grow the job goes on without that host.
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hosts.harness import assert_no_orphans, env_for, new_marker

from ringtrain import processes
from ringtrain.launch import agent, job
from ringtrain.launch.cli import main
from ringtrain.launch.elastic.workers import JobWorkers
from ringtrain.launch.elastic.worlds import ElasticConfig, WorkerOnHost
from ringtrain.launch.hosts import Host
from ringtrain.launch.members import StartFailure
from ringtrain.launch.output import OutputSink

FAR_HOST = "10.213.99.98"  # no test machine has it: ringrun takes it for a remote host


class _Failed:
    """A member whose rank failed at a given time."""

    def __init__(self, rank: int, code: int, when: float) -> None:
        self.ranks, self.rank, self.code, self.when = (rank,), rank, code, when

    def exits(self) -> dict[int, int]:
        return {self.rank: self.code}

    def exit_time(self, rank: int) -> float:
        return self.when


def test_the_rank_that_failed_first_is_named_not_the_lowest() -> None:
    # Both exits seen in one look: rank 1 died first, rank 0 (its peer gone) after it.
    members: list[Any] = [_Failed(0, 5, when=2.0), _Failed(1, 3, when=1.0), _Failed(2, 0, when=0.5)]
    failed, rank, code = job._watch(members, [], OutputSink(None))
    assert (rank, code) == (1, 3) and failed is members[1]


@pytest.mark.timeout(30)
def test_a_child_notes_when_it_exited_without_being_polled() -> None:
    marker = new_marker()
    first = processes.Child(["sh", "-c", "exit 1"], env_for(marker))
    second = processes.Child(["sh", "-c", "sleep 0.3; exit 2"], env_for(marker))
    for child in (first, second):
        child.pump(lambda piece, partial: None)
    deadline = time.monotonic() + 10
    while (first.exited_at is None or second.exited_at is None) and time.monotonic() < deadline:
        time.sleep(0.01)
    # Noted by the waiters, though nothing polled them: the first to exit is first.
    assert first.exited_at is not None and second.exited_at is not None
    assert second.exited_at - first.exited_at > 0.2
    assert (first.poll(), second.poll()) == (1, 2)  # Popen still reaps them


def _refuse_once(monkeypatch: pytest.MonkeyPatch, attempt: str, code: int) -> list[str]:
    """Popen refuses rank 1 of attempt ``attempt`` with ``code``; the attempts started."""
    real = subprocess.Popen
    seen: list[str] = []

    class Refuses(real):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
            env = kwargs.get("env") or {}
            if env.get("RINGTRAIN_RANK") == "1":
                seen.append(env["RINGTRAIN_ATTEMPT"])
                if env["RINGTRAIN_ATTEMPT"] == attempt:
                    raise OSError(code, os.strerror(code))
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(processes.subprocess, "Popen", Refuses)
    return seen


#: Fails on its first attempt, succeeds on any later one.
FAILS_FIRST = [sys.executable, "-c", "import os, sys; sys.exit(os.environ['RINGTRAIN_ATTEMPT'] == '0')"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("attempt,restarts", [("0", 1), ("1", 2)])
def test_a_rank_that_cannot_start_for_now_is_a_failed_attempt(
        attempt: str, restarts: int, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    marker = new_marker()
    monkeypatch.setenv("RINGTEST_MARKER", marker)
    seen = _refuse_once(monkeypatch, attempt, errno.EMFILE)
    command = FAILS_FIRST if attempt == "1" else [sys.executable, "-c", "pass"]
    rc = main(["-np", "2", "--oversubscribe", "--max-restarts", str(restarts), *command])
    err = capsys.readouterr().err
    assert rc == 0, err  # was 1: the restart's start failure ended the job
    assert "cannot start rank 1" in err and "Too many open files" in err
    assert f"restarting the job (restart {restarts} of {restarts})" in err
    assert seen[-1] == str(restarts)
    assert_no_orphans(marker)


@pytest.mark.timeout(30)
def test_a_rank_that_can_never_start_ends_the_job_without_burning_restarts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    marker = new_marker()
    monkeypatch.setenv("RINGTEST_MARKER", marker)
    seen = _refuse_once(monkeypatch, "1", errno.ENOEXEC)
    rc = main(["-np", "2", "--oversubscribe", "--max-restarts", "3", *FAILS_FIRST])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.strip().splitlines()[-1].startswith("ringrun: error: cannot start rank 1"), err
    assert seen == ["0", "1"] and "restart 2 of 3" not in err
    assert_no_orphans(marker)


@pytest.mark.timeout(30)
def test_a_remote_rank_that_can_never_start_is_not_restarted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A stand-in for the host agent: ready, the rendezvous port, then its F line.
    fake = tmp_path / "agent.py"
    fake.write_text(
        "import sys\n"
        "print('R ' + '{\"ifaces\": {}, \"server_addr\": \"127.0.0.1\"}', flush=True)\n"
        "sys.stdin.readline()\n"
        "print('L 1', flush=True)\n"
        "print(\"F cannot start rank 0 on host far ('train': Exec format error); fix it\", flush=True)\n")
    calls: list[int] = []

    def ssh_argv(*_args: Any) -> list[str]:
        calls.append(1)
        return [sys.executable, str(fake)]

    monkeypatch.setattr(job, "ssh_argv", ssh_argv)
    rc = main(["-np", "1", "-H", f"{FAR_HOST}:1", "--max-restarts", "2", "/bin/true"])
    err = capsys.readouterr().err
    assert rc == 1 and len(calls) == 1, err  # was: restarted twice, exit 255
    assert err.strip().splitlines()[-1].startswith(f"ringrun: error: host {FAR_HOST}: cannot start rank 0"), err


def test_the_host_agent_names_the_rank_it_is_given_and_whether_it_repeats(tmp_path: Path) -> None:
    garbage = tmp_path / "train"
    garbage.write_bytes(b"\x7fELF not a program")
    garbage.chmod(0o755)
    spec = {"cwd": str(tmp_path), "command": [str(garbage)],
            "ranks": [{"rank": 7, "label": "rank 1", "local_size": 1, "env": {}}]}
    with pytest.raises(agent._Refused, match=r"cannot start rank 1 on host .*Exec format error") as refused:
        agent._Agent(io.BytesIO()).start(spec, None)
    assert refused.value.repeats


@pytest.mark.timeout(30)
def test_a_resizable_job_names_the_rank_that_cannot_start_and_stops_the_new_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = new_marker()
    monkeypatch.setenv("RINGTEST_MARKER", marker)
    _refuse_once(monkeypatch, "0", errno.EAGAIN)
    ecfg = ElasticConfig(min_np=1, max_np=4, hosts=(Host("localhost", 4),))
    cfg = job.JobConfig(command=("sleep", "30"), placements=(), elastic=ecfg)
    workers = JobWorkers(cfg, "t6", OutputSink(None), [], None, str(tmp_path / "job"))
    host = workers.register("localhost", None, {})
    order = [WorkerOnHost(5, "localhost"), WorkerOnHost(6, "localhost")]  # workers 5, 6 as ranks 0, 1
    with pytest.raises(StartFailure, match=r"cannot start rank 1 on localhost .*Resource temporarily") as failed:
        workers.launch(order, order, [], "test", 3)
    assert "rank 6" not in str(failed.value) and not failed.value.repeats
    assert host.workers == []
    assert_no_orphans(marker, within=3.0)  # worker 5 ran, and was stopped


def test_a_grow_whose_rank_cannot_start_goes_on_without_the_host(tmp_path: Path) -> None:
    from test_launch_elastic_driver import S, _running

    job6 = _running(tmp_path)
    job6.workers.refuse = StartFailure("cannot start rank 2 on nodeb ('train': Too many open files); ...",
                                       repeats=False)
    job6.discovery.list([Host("127.0.0.1", 2), Host("nodeb", 1)])
    job6.step()
    assert job6.step() is S.RUNNING and job6.driver.version == 0  # was: the job ended
    assert "nodeb" not in job6.workers.hosts and job6.driver.blacklist.blocked("nodeb")
    assert job6.workers.made["nodeb"].stopped

