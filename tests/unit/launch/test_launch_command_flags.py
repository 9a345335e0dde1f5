"""The command's own flags reach the command, whatever they are called: argparse matched
every ``-`` token against the launcher's flags, the command's too, so
``ringrun -np 2 python train.py --max 5`` failed with "ambiguous option: --max could
match --max-np, --max-restarts" (and ``--out``, ``--st``, ``--no``, ``--log`` alike).
The launcher's own flags before the command still take Horovod's and argparse's
abbreviations."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch import cli
from ringtrain.launch.horovodrun import translate

SCRIPT_FLAGS = ["--max", "5", "--min", "1", "--out", "x", "--st", "2", "--no", "--log", "a",
                "-np", "3", "--seed", "-1", "-H", "h:1"]


@pytest.mark.parametrize("sep", [[], ["--"]])
def test_ringrun_passes_the_commands_flags_through(sep: list[str]) -> None:
    cfg = cli.build_config(["-np", "1", *sep, "python", "-c", "pass", *SCRIPT_FLAGS])
    assert cfg.command == ("python", "-c", "pass", *SCRIPT_FLAGS)
    assert len(cfg.placements) == 1


def test_horovodrun_passes_the_commands_flags_through() -> None:
    argv = translate(["-np", "1", "python", "t.py", *SCRIPT_FLAGS], {}).ringrun_argv
    assert argv[argv.index("--") + 1:] == ["python", "t.py", *SCRIPT_FLAGS]


def test_launcher_flags_before_the_command_keep_their_abbreviations_and_values() -> None:
    cfg = cli.build_config(["--oversub", "-np", "3", "-x", "A=-1", "--output-filename=logs",
                            "python", "-c", "pass", "--oversub"])
    assert len(cfg.placements) == 3 and cfg.output_dir == "logs"
    assert cfg.command == ("python", "-c", "pass", "--oversub")
    with pytest.raises(ConfigError, match="ambiguous option: --max"):
        cli.build_config(["--max", "2", "-np", "1", "python", "t.py"])  # the launcher's own


def test_an_ambiguous_launcher_flag_is_a_config_error_where_argparse_raises_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Python 3.13.0's _parse_optional raises ArgumentError for an ambiguous abbreviation
    # (3.11 and 3.12 call error() there): the scan for the command calls it outside
    # parse_known_args, so it escaped as a traceback instead of ringrun's one-line error.
    import argparse

    parser = cli.build_parser()
    real = parser._parse_optional

    def like_313(token: str):  # type: ignore[no-untyped-def]
        if token == "--max":
            raise argparse.ArgumentError(None, "ambiguous option: --max could match --max-np, --max-restarts")
        return real(token)

    monkeypatch.setattr(parser, "_parse_optional", like_313)
    with pytest.raises(ConfigError, match="ambiguous option: --max"):
        parser.parse_args(["--max", "2", "-np", "1", "python", "t.py"])
