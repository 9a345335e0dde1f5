"""The loader's first worker count from the CPU budget, and the worker-count hill climber
(the budget itself: tests/unit/core/test_cpus.py)."""

from __future__ import annotations

import pytest

from ringtrain.cpus import CpuBudget
from ringtrain.data.autotune import Autotuner, initial_workers


@pytest.mark.parametrize("cpus,expected", [(0.5, 1), (1, 1), (2, 2), (3, 2), (8, 7)])
def test_initial_workers(cpus: float, expected: int) -> None:
    assert initial_workers(CpuBudget(affinity=64, quota=cpus)) == expected


def _feed(t: Autotuner, wait: float, busy: float, batches: int) -> list[int]:
    changes = []
    for _ in range(batches):
        n = t.observe(wait, busy)
        if n is not None:
            changes.append(n)
    return changes


def test_autotuner_grows_while_more_workers_cut_the_wait() -> None:
    t = Autotuner(2, high=4, window_batches=10, window_s=0.0)
    assert _feed(t, wait=0.5, busy=0.5, batches=10) == [3]  # 50% waiting: try one more
    assert _feed(t, wait=0.2, busy=0.8, batches=10) == []  # it helped: keep 3
    assert _feed(t, wait=0.2, busy=0.8, batches=10) == [4]  # still waiting: try 4
    assert t.n == 4


def test_autotuner_reverts_a_useless_worker_and_backs_off() -> None:
    t = Autotuner(2, high=8, window_batches=10, window_s=0.0)
    assert _feed(t, 0.5, 0.5, 10) == [3]
    assert _feed(t, 0.5, 0.5, 10) == [2]  # no better: revert
    assert "did not cut" in t.reason
    assert _feed(t, 0.5, 0.5, 10) == []  # cooling down
    assert _feed(t, 0.5, 0.5, 10) == [3]  # try again later
    assert _feed(t, 0.5, 0.5, 10) == [2]
    assert _feed(t, 0.5, 0.5, 20) == []  # back-off doubled


def test_autotuner_leaves_a_fed_loop_alone() -> None:
    t = Autotuner(2, high=8, window_batches=10, window_s=0.0)
    assert _feed(t, 0.001, 1.0, 100) == []
    assert t.n == 2
