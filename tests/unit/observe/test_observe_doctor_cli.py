"""ringtrain doctor's argument handling (no process started)."""

from __future__ import annotations

import pytest

from ringtrain import cli
from ringtrain.observe import doctor


@pytest.mark.parametrize("argv,message", [
    (["doctor"], "no command given"),
    (["doctor", "--"], "no command given"),
    (["doctor", "-np", "0", "--", "python", "x.py"], "-np must be >= 1"),
    (["doctor", "--steps", "-1", "--", "python", "x.py"], "must be >= 0"),
    (["doctor", "--", "no-such-command-xyz"], "not found"),
    (["doctor", "--bogus"], "see 'ringtrain doctor --help'"),
])
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == doctor.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_ringrun_is_used_for_more_than_one_rank() -> None:
    args = doctor.build_parser().parse_args(["-np", "3", "--", "python", "t.py"])
    command = doctor.build_command(args)
    assert command[1:5] == ["-m", "ringtrain.launch.cli", "-np", "3"]
    assert command[-2:] == ["python", "t.py"]
    many = doctor.build_command(doctor.build_parser().parse_args(["-np", "9", "--oversubscribe", "--", "python", "t.py"]))
    assert many[1:6] == ["-m", "ringtrain.launch.cli", "-np", "9", "--oversubscribe"]
    one = doctor.build_command(doctor.build_parser().parse_args(["python", "t.py", "--lr", "1"]))
    assert one == ["python", "t.py", "--lr", "1"]
