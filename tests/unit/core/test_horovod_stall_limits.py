"""ringtrain.horovod's stall check: Horovod's variables, ringtrain's limit when set."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.horovod.stall import DEFAULT_WARNING_S, stall_limits


@pytest.mark.parametrize("env,want", [
    ({}, (DEFAULT_WARNING_S, None)),  # Horovod's default: warn every 60 s, never give up
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}, (5.0, None)),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"}, (60.0, 120.0)),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}, (60.0, None)),
    ({"RINGTRAIN_STALL_TIMEOUT": "30"}, (60.0, 42.0)),  # ringtrain's setting (42 here) is the limit
    ({"RINGTRAIN_STALL_TIMEOUT": "30", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9"}, (60.0, 42.0)),
    ({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9"}, (None, None)),
    ({"HOROVOD_STALL_CHECK_DISABLE": "1", "RINGTRAIN_STALL_TIMEOUT": "30"}, (None, 42.0)),
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "0"}, (None, None)),
])
def test_limits_follow_horovods_variables(env: dict[str, str], want: tuple[float | None, float | None]) -> None:
    assert stall_limits(env, 42.0) == want


@pytest.mark.parametrize("name,raw", [("HOROVOD_STALL_CHECK_TIME_SECONDS", "soon"),
                                      ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-1"),
                                      ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "nan")])
def test_a_bad_value_names_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}='{raw}' is not a number of seconds >= 0"):
        stall_limits({name: raw}, 60.0)
