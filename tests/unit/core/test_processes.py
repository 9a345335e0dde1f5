"""ringtrain's one stop sequence (ringtrain.processes): ask all, wait the grace, kill the rest."""

from __future__ import annotations

import subprocess
import time

from ringtrain.processes import PlainProcess, stop_sequence


class _Fake:
    def __init__(self, log: list[str], name: str, obeys: bool) -> None:
        self.log, self.name, self.obeys, self.up = log, name, obeys, True

    def alive(self) -> bool:
        return self.up

    def request_stop(self) -> None:
        self.log.append(f"term {self.name}")
        self.up = self.up and not self.obeys

    def force_kill(self) -> None:
        self.log.append(f"kill {self.name}")
        self.up = False


def test_every_member_is_asked_before_any_is_killed() -> None:
    log: list[str] = []
    members = [_Fake(log, "a", obeys=True), _Fake(log, "b", obeys=False)]
    started = time.monotonic()
    stop_sequence(members, grace=0.3, after_request=lambda: log.append("strays"),
                  after_kill=lambda: log.append("end"))
    assert log == ["term a", "term b", "strays", "kill a", "kill b", "end"]
    assert time.monotonic() - started >= 0.3  # b ignored the request: the grace was waited


def test_no_wait_when_everyone_obeys() -> None:
    log: list[str] = []
    started = time.monotonic()
    stop_sequence([_Fake(log, "a", obeys=True)], grace=30.0)
    assert time.monotonic() - started < 5.0 and log == ["term a", "kill a"]


def test_real_processes_stop_politely_or_are_killed() -> None:
    polite = subprocess.Popen(["sleep", "30"])
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 30"])  # SIG_IGN survives exec
    time.sleep(0.2)  # let the shell install its trap
    stop_sequence([PlainProcess(polite), PlainProcess(stubborn)], grace=0.3)
    assert polite.returncode == -15 and stubborn.returncode == -9


def test_a_child_is_stopped_with_its_process_group_and_its_output_is_pumped() -> None:
    import os

    from ringtrain.processes import Child

    got: list[bytes] = []
    child = Child(["sh", "-c", "echo started; sleep 30 & wait"], dict(os.environ))
    child.pump(lambda piece, partial: got.append(piece))
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    stop_sequence([child], grace=2.0)
    child.join_output(2.0)
    assert got == [b"started\n"] and child.poll() is not None
    assert _group_gone(child.pid, within=5.0), "the sleep in the child's group must be gone too"


def _group_gone(pgid: int, within: float) -> bool:
    """Whether no process of group ``pgid`` is left, a dead one's reaping by init included."""
    import os

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False
