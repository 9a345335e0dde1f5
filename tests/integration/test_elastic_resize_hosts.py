"""A resizable job across hosts: 3 namespace hosts, one is killed mid-epoch (every process
on it, its sshd too: the machine is gone), the job goes on with 2; the host comes back
(the discovery script lists it again) and the job grows to 3 at its next commit.

The script is the seed CNN (examples/mnist_cnn.py's model on the bundled digits) written
against ``hvd.elastic`` (scripts/hvd_elastic_resize.py). Checked, besides a clean exit
and no process left on any host: training went on at 2 ranks within 30 s of the kill
(measured generously: the first step of the smaller world), the sizes were 3, 2, 3,
every sample of every epoch was trained on exactly once, and the final test accuracy is
within 1 point of an uninterrupted 3-rank run. The timeline (detect, re-form, resume;
and for the grow) is printed and written to ``timeline.json`` in the test's directory.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hosts import elastic_hosts
from hosts.elastic_hosts import ElasticHosts
from hosts.harness import RINGRUN, assert_no_orphans, env_for, new_marker

pytestmark = pytest.mark.system  # `make test-system`: see docs/testing.md

SCRIPT = str(Path(__file__).parent / "scripts" / "hvd_elastic_resize.py")
EPOCHS = 16
#: Epoch 2, batch 10 of 15: mid-epoch (1438 samples, 3 ranks x 32 per step).
KILL_AT_STEP = 40


#: A traceback's lines as a worker's output prefixes them ("[1]   File ...", "[1] Traceback").
_TRACEBACK = re.compile(r"^\[\d+\] (\s|Traceback|\w+Error:|\^)")


@pytest.fixture(scope="module")
def hosts() -> Iterator[ElasticHosts]:
    yield elastic_hosts.build(3)
    elastic_hosts.teardown()


class _Job:
    """ringrun running, its output lines with the time each arrived."""

    def __init__(self, argv: list[str], marker: str, out: Path) -> None:
        self.out = out
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env_for(marker), cwd=str(Path(__file__).parents[2]))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def events(self) -> list[dict[str, Any]]:
        try:
            text = Path(str(self.out) + ".events").read_text()
        except OSError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def wait_for(self, what: str, test: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = test()
            if got:
                return got
            assert self.proc.poll() is None, f"ringrun ended while waiting for {what}:\n{self.text()}"
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {timeout:g} s:\n{self.text()}")

    def line_time(self, fragment: str, after: float = 0.0) -> float | None:
        return next((t for t, line in self.lines if fragment in line and t >= after), None)

    def step_time(self, size: int, after: float) -> float | None:
        return next((e["time"] for e in self.events() if e["event"] == "step" and e["size"] == size
                     and e["time"] >= after), None)

    def text(self) -> str:
        # ringrun's lines and the workers' log lines, not their tracebacks: what a failure
        # report's last lines must show is the order of events
        return "\n".join(line for _, line in self.lines if "frame #" not in line
                         and not _TRACEBACK.match(line))[-6000:]


@pytest.fixture(scope="module")
def uninterrupted_accuracy(tmp_path_factory: pytest.TempPathFactory) -> float:
    d = tmp_path_factory.mktemp("uninterrupted")
    marker = new_marker()
    res = subprocess.run([RINGRUN, "-np", "3", "--oversubscribe", "python", SCRIPT, str(d / "out.json"),
                          "--epochs", str(EPOCHS)], capture_output=True, text=True, timeout=400,
                         env=env_for(marker))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert_no_orphans(marker)
    return float(json.loads((d / "out.json").read_text())["accuracy"])


def _write_hosts(path: Path, addrs: tuple[str, ...]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{a}:1\n" for a in addrs))
    tmp.replace(path)  # the script never reads half a file


@pytest.mark.timeout(900)
def test_three_hosts_shrink_to_two_when_one_dies_and_grow_back_when_it_returns(
        hosts: ElasticHosts, uninterrupted_accuracy: float, tmp_path: Path) -> None:
    marker = new_marker()
    listed = tmp_path / "hosts.txt"
    _write_hosts(listed, hosts.addrs)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {listed}\n")
    discover.chmod(0o755)
    out = tmp_path / "out.json"
    lost = hosts.addrs[2]
    job = _Job([RINGRUN, *hosts.ssh_flags, "-x", "RINGTEST_MARKER", "--min-np", "2", "--max-np", "3",
                "--host-discovery-script", str(discover), "python", SCRIPT, str(out),
                "--epochs", str(EPOCHS)], marker, out)
    try:
        job.wait_for(f"step {KILL_AT_STEP} at 3 ranks", lambda: any(
            e["event"] == "step" and e["step"] >= KILL_AT_STEP and e["size"] == 3 for e in job.events()),
            timeout=400)
        _write_hosts(listed, hosts.addrs[:2])
        t_kill = time.time()
        assert elastic_hosts.kill_host(hosts, lost) > 0
        t_detect = job.wait_for("the loss", lambda: job.line_time(f"host {lost} was lost", t_kill - 1), 60)
        t_formed = job.wait_for("world 1", lambda: job.line_time("world 1 formed: 2 rank(s)"), 60)
        t_resume = job.wait_for("a step at 2 ranks", lambda: job.step_time(2, t_kill), 60)
        assert t_resume - t_kill < 30, f"training went on {t_resume - t_kill:.1f} s after the kill:\n{job.text()}"
        job.wait_for("10 steps at 2 ranks", lambda: sum(
            e["event"] == "step" and e["size"] == 2 for e in job.events()) >= 10, 120)

        elastic_hosts.revive_host(hosts)
        _write_hosts(listed, hosts.addrs)
        t_back = time.time()
        t_added = job.wait_for("the host back", lambda: job.line_time(f"host {lost} added", t_back), 90)
        t_grown = job.wait_for("world 2", lambda: job.line_time("world 2 formed: 3 rank(s)"), 120)
        t_resume3 = job.wait_for("a step at 3 ranks again", lambda: job.step_time(3, t_back), 120)
        assert job.proc.wait(timeout=600) == 0, job.text()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait(10)
        (tmp_path / "ringrun.log").write_text(job.text())
        elastic_hosts.revive_host(hosts)  # the next test needs every host, whatever happened here

    got = json.loads(out.read_text())
    assert got["sizes"] == [3, 2, 3], got["sizes"]
    assert sorted(map(int, got["seen"])) == list(range(EPOCHS))
    coverage = {}
    for epoch, ids in got["seen"].items():
        coverage[epoch] = (len(ids), len(set(ids)))
        assert sorted(ids) == list(range(got["samples"])), f"epoch {epoch}: a sample lost or repeated"
    assert abs(got["accuracy"] - uninterrupted_accuracy) <= 0.01, (got["accuracy"], uninterrupted_accuracy)
    assert "restarting" not in job.text()

    timeline = {
        "detect_s": round(t_detect - t_kill, 2), "reform_s": round(t_formed - t_detect, 2),
        "resume_s": round(t_resume - t_formed, 2), "kill_to_training_s": round(t_resume - t_kill, 2),
        "grow_discovered_s": round(t_added - t_back, 2), "grow_formed_s": round(t_grown - t_added, 2),
        "grow_resume_s": round(t_resume3 - t_grown, 2), "back_to_training_s": round(t_resume3 - t_back, 2),
        "accuracy": got["accuracy"], "uninterrupted_accuracy": uninterrupted_accuracy,
        "epochs_exactly_once": f"{len(coverage)}/{EPOCHS}", "samples": got["samples"],
        "sizes": got["sizes"], "steps": got["steps"],
    }
    (tmp_path / "timeline.json").write_text(json.dumps(timeline, indent=1))
    print("resize timeline:", json.dumps(timeline))
    assert_no_orphans(marker)
    deadline = time.monotonic() + 10
    while elastic_hosts.leftovers(hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not elastic_hosts.leftovers(hosts)


@pytest.mark.timeout(600)
def test_a_host_that_vanishes_silently_is_dropped_and_nobody_waits_for_it(
        hosts: ElasticHosts, tmp_path: Path) -> None:
    """Its link goes down first, then everything on it dies: no connection is closed,
    no RST reaches anyone. ringrun notices through ssh's keep-alive; the survivors,
    blocked in a collective with the dead host, are freed by closing their own ends of
    its connections, and go on with 2 within 30 s of the loss.

    The keep-alive is set through ``--ssh-option`` to 2 s x 2 (ringrun's own 5 s x 3 is
    ~15 s of waiting, and the user's options come first on ssh's command line): ~4-6 s
    to notice, and a live sshd (same kernel, answering at once) would have to stay silent
    for 4 s on end to be taken for a dead one, hundreds of times a loaded 2-core
    machine's scheduling delay. Two epochs: the loss lands mid-epoch 1 (15 steps an
    epoch at 3 ranks), so the rest of that epoch and the run's end are at 2 ranks."""
    marker = new_marker()
    listed = tmp_path / "hosts.txt"
    _write_hosts(listed, hosts.addrs)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {listed}\n")
    discover.chmod(0o755)
    out = tmp_path / "out.json"
    lost = hosts.addrs[2]
    ns = hosts.namespace(lost)
    job = _Job([RINGRUN, *hosts.ssh_flags, "-x", "RINGTEST_MARKER", "--min-np", "2", "--max-np", "3",
                # the workers' debug lines (worlds seen, connections closed) in a failure's report
                "--log-level", "debug",
                "--ssh-option", "ServerAliveInterval=2", "--ssh-option", "ServerAliveCountMax=2",
                "--host-discovery-script", str(discover), "python", SCRIPT, str(out), "--epochs", "2"],
               marker, out)
    try:
        job.wait_for("step 20 at 3 ranks", lambda: any(
            e["event"] == "step" and e["step"] >= 20 and e["size"] == 3 for e in job.events()), timeout=400)
        _write_hosts(listed, hosts.addrs[:2])
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "down"], check=True)
        t_kill = time.time()
        elastic_hosts.kill_host(hosts, lost)
        t_detect = job.wait_for("the loss", lambda: job.line_time(f"host {lost} was lost", t_kill), 60)
        t_resume = job.wait_for("a step at 2 ranks", lambda: job.step_time(2, t_kill), 60)
        assert t_resume - t_kill < 30, f"training went on {t_resume - t_kill:.1f} s after the loss:\n{job.text()}"
        assert job.proc.wait(timeout=400) == 0, job.text()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait(10)
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        elastic_hosts.revive_host(hosts)
    got = json.loads(out.read_text())
    assert got["sizes"] == [3, 2]
    for epoch, ids in got["seen"].items():
        assert sorted(ids) == list(range(got["samples"])), f"epoch {epoch}: a sample lost or repeated"
    print("silent loss:", json.dumps({"detect_s": round(t_detect - t_kill, 2),
                                      "kill_to_training_s": round(t_resume - t_kill, 2)}))
    assert_no_orphans(marker)
    deadline = time.monotonic() + 10
    while elastic_hosts.leftovers(hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not elastic_hosts.leftovers(hosts)
