"""ringtrain's one stop sequence (ringtrain.stopping): ask all, wait the grace, kill the rest."""

from __future__ import annotations

import subprocess
import time

from ringtrain.stopping import PlainProcess, stop_sequence


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
