"""Horovod's rule for a stall shutdown time shorter than the warning interval: its stall
inspector ignores it ("will not shutdown"), so a slow rank is waited for."""

from __future__ import annotations

import logging

import pytest

from ringtrain.horovod.stall import stall_limits


@pytest.mark.parametrize("env,want", [
    # Before: a 30 s limit, where Horovod waits (its check runs once per 60 s interval).
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}, (60.0, None)),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30", "HOROVOD_STALL_CHECK_TIME_SECONDS": "40"}, (40.0, None)),
])
def test_a_shutdown_time_below_the_check_time_is_ignored_with_a_warning(
        env: dict[str, str], want: tuple[float | None, float | None], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ringtrain.horovod"):
        assert stall_limits(env, 42.0) == want
    assert "is less than HOROVOD_STALL_CHECK_TIME_SECONDS" in caplog.text


@pytest.mark.parametrize("env,want", [
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}, (60.0, 60.0)),  # not less: kept
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}, (5.0, 9.0)),
    # Horovod compares with the interval itself: 0 (warn at every check) keeps any limit.
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9", "HOROVOD_STALL_CHECK_TIME_SECONDS": "0"}, (None, 9.0)),
])
def test_a_shutdown_time_at_least_the_check_time_is_kept(
        env: dict[str, str], want: tuple[float | None, float | None], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ringtrain.horovod"):
        assert stall_limits(env, 42.0) == want
    assert "is less than" not in caplog.text
