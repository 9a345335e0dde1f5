"""The bubble's bookkeeping: idle gaps between a stage's own work (no processes)."""

from __future__ import annotations

import pytest

from ringtrain.parallel.pipeline import StageTimes, idle_gaps


def test_gaps_are_what_no_busy_span_covers() -> None:
    busy = [(2.0, 3.0), (1.0, 1.5), (2.5, 4.0), (6.0, 12.0)]
    assert idle_gaps(0.0, 10.0, busy) == [(0.0, 1.0), (1.5, 2.0), (4.0, 6.0)]


def test_no_work_is_all_gap_and_full_work_is_none() -> None:
    assert idle_gaps(0.0, 1.0, []) == [(0.0, 1.0)]
    assert idle_gaps(0.0, 1.0, [(-1.0, 2.0)]) == []


def test_bubble_share_skips_the_first_step() -> None:
    times = StageTimes(steps=[10.0, 1.0, 1.0], idle=[9.0, 0.1, 0.3])
    assert times.bubble_share(skip=1) == pytest.approx(0.2)
    assert times.bubble_share(skip=3) == 0.0
