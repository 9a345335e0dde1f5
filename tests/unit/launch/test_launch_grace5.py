"""``--stop-grace`` (pure parts): the flag to the config, its check, the grace a remote
agent is told, and a second signal cutting the grace short."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from ringtrain.launch.agent import GRACE_S, agent_grace
from ringtrain.launch.cli import build_config, main
from ringtrain.launch.hosts import Placement
from ringtrain.launch.job import STOP_GRACE_S, JobConfig, _spec
from ringtrain.launch.members import stop_all

PY = sys.executable


def test_the_default_grace_is_unchanged() -> None:
    cfg = build_config(["-np", "1", PY, "-c", "pass"])
    assert cfg.stop_grace == STOP_GRACE_S == 2.5
    assert agent_grace(STOP_GRACE_S) == GRACE_S == 1.5  # the agent's own, as before


@pytest.mark.parametrize("value,seconds", [("8", 8.0), ("0", 0.0), ("30.5", 30.5)])
def test_stop_grace_reaches_the_config(value: str, seconds: float) -> None:
    assert build_config(["--stop-grace", value, "-np", "1", PY, "-c", "pass"]).stop_grace == seconds


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf"])
def test_a_bad_stop_grace_is_one_error_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([f"--stop-grace={value}", "-np", "1", PY, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringrun: error:") and "--stop-grace" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("grace,agent", [(0.0, 0.0), (1.0, 0.5), (2.5, 1.5), (30.0, 29.0)])
def test_an_agent_stops_its_ranks_before_ringrun_would(grace: float, agent: float) -> None:
    assert agent_grace(grace) == agent and agent <= grace


def test_the_spec_carries_the_agents_grace() -> None:
    cfg = JobConfig(command=("true",), placements=(Placement(0, "h1", 0, 1, 0, 1),), stop_grace=8.0)
    host = type("H", (), {"ranks": (0,)})()
    spec = _spec(cfg, host, "10.0.0.1", 29500, 0, "run", "/", {}, {0: {}}, listen=None)  # type: ignore[arg-type]
    assert spec["stop_grace"] == agent_grace(8.0) == 7.0


class _Stubborn:
    """A member that never ends by itself: only SIGKILL (``force_kill``) ends it."""

    ranks = (0,)
    stop_signal = signal.SIGTERM

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.killed = False

    def alive(self) -> bool:
        return not self.killed

    def request_stop(self) -> None:
        self.asked.append(self.stop_signal)

    def force_kill(self) -> None:
        self.killed = True

    def finish_output(self, timeout: float = 2.0) -> None:
        pass


@pytest.mark.timeout(20)
def test_a_second_signal_cuts_the_grace_short() -> None:
    member, signals = _Stubborn(), [int(signal.SIGINT)]
    start = time.monotonic()

    def second_ctrl_c() -> bool:  # arrives 0.2 s into a 60 s grace
        if time.monotonic() - start > 0.2 and len(signals) == 1:
            signals.append(int(signal.SIGINT))
        return len(signals) > 1

    stop_all([member], grace=60.0, signum=signal.SIGINT, cut_short=second_ctrl_c)  # type: ignore[list-item]
    assert member.asked == [signal.SIGINT] and member.killed
    assert time.monotonic() - start < 10
