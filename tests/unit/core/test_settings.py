from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.settings import env_name, load_settings


def test_defaults_env_and_override_precedence() -> None:
    assert load_settings({}).stall_timeout == 60.0
    assert load_settings({"RINGTRAIN_STALL_TIMEOUT": "5"}).stall_timeout == 5.0
    assert load_settings({"RINGTRAIN_STALL_TIMEOUT": "5"}, stall_timeout=7.0).stall_timeout == 7.0
    assert load_settings({"RINGTRAIN_PROGRESS": "0"}).progress is False
    assert env_name("fusion_mb") == "RINGTRAIN_FUSION_MB"


@pytest.mark.parametrize("env", [
    {"RINGTRAIN_BACKEND": "mpi"}, {"RINGTRAIN_FUSION_MB": "-1"}, {"RINGTRAIN_INIT_TIMEOUT": "soon"},
])
def test_bad_settings_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="RINGTRAIN_|backend"):
        load_settings(env)
