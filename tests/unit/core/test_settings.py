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


def test_a_misspelt_variable_is_named_with_the_one_meant() -> None:
    from ringtrain.settings import unknown_variables

    got = unknown_variables({"RINGTRAIN_STALL_TIMOUT": "5", "RINGTRAIN_STALL_TIMEOUT": "5",
                             "RINGTRAIN_RANK": "0", "RINGTRAIN_WHATEVER": "1", "HOME": "/"})
    assert got == ["RINGTRAIN_STALL_TIMOUT is not a ringtrain variable; did you mean RINGTRAIN_STALL_TIMEOUT?",
                   "RINGTRAIN_WHATEVER is not a ringtrain variable and has no effect"]


def test_every_variable_the_package_reads_is_known() -> None:
    # a name the code uses but the list lacks would be warned about as a typo
    import re
    from dataclasses import fields
    from pathlib import Path

    import ringtrain
    from ringtrain.settings import OTHER_VARIABLES, Settings

    root = Path(ringtrain.__file__).parent
    used = {m for f in root.rglob("*.py") for m in re.findall(r"RINGTRAIN_[A-Z0-9_]*[A-Z0-9]", f.read_text())}
    known = OTHER_VARIABLES | {env_name(f.name) for f in fields(Settings)}
    assert used - known == set()


def test_ringrun_warns_about_a_variable_it_does_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from ringtrain.launch import cli

    monkeypatch.setenv("RINGTRAIN_FUSION_MBS", "64")
    cfg = cli.build_config(["-np", "1", "-x", "RINGTRAIN_OBSERVER=0", sys.executable, "-c", "pass"])
    warned = cli.launch_warnings(cfg)
    assert "RINGTRAIN_FUSION_MBS is not a ringtrain variable; did you mean RINGTRAIN_FUSION_MB?" in warned
    assert "RINGTRAIN_OBSERVER is not a ringtrain variable; did you mean RINGTRAIN_OBSERVE?" in warned
