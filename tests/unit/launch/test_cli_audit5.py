"""Bad input to ringrun / horovodrun: one error line naming the problem and the fix, exit 2,
nothing started (audit 5). In-process: ``main(argv)`` fails before ``run_job``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch import cli, horovodrun
from ringtrain.launch.horovod_config import config_values
from ringtrain.launch.hosts import Host, parse_hostfile, parse_hosts, place_ranks


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('never run')\n")
    return str(path)


def _hostfile(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "hosts"
    path.write_bytes(data)
    return str(path)


def test_ringrun_main_on_a_binary_hostfile_is_one_line_not_a_traceback(
        tmp_path: Path, script: str, capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = _hostfile(tmp_path, b"\xff\xfe\x00binary")
    assert cli.main(["-np", "2", "--hostfile", hostfile, sys.executable, script]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a text file" in err and "Traceback" not in err


@pytest.mark.parametrize("line", [
    "localhost:0",          # was a host with 0 slots (and a ZeroDivisionError with --oversubscribe)
    "localhost:",           # was a host named 'localhost:' handed to ssh
    "server1:2 slots=4",    # which one?
    "server1 slots=2 slots=3",
    "server1 slots=２",      # a non-ASCII digit
])
def test_hostfile_entries_that_were_taken_at_face_value_are_refused(tmp_path: Path, line: str) -> None:
    with pytest.raises(ConfigError, match="line 1; write 'host slots=N'"):
        parse_hostfile(_hostfile(tmp_path, f"{line}\n".encode()))


def test_oversubscribing_hosts_without_slots_is_an_error_not_a_division_by_zero() -> None:
    with pytest.raises(ConfigError, match="no slots"):
        place_ranks([Host("a", 0)], 2, oversubscribe=True)


@pytest.mark.parametrize("spec,want", [
    ("[::1]:2", [Host("::1", 2)]),        # the name was '[::1]': ssh could not resolve it
    ("[::1]", [Host("::1", 1)]),
    ("[fe80::1]:4,b:2", [Host("fe80::1", 4), Host("b", 2)]),
])
def test_bracketed_ipv6_hosts_lose_their_brackets(spec: str, want: list[Host]) -> None:
    assert parse_hosts(spec) == want


@pytest.mark.parametrize("spec,fragment", [
    ("::1", "in brackets"),               # was host ':' with 1 slot
    ("fe80::1:2", "in brackets"),         # fe80::1:2, or fe80::1 with 2 slots?
    ("[server1]:2", "not an IPv6 address"),
    ("[::1]x", "write an IPv6 address as"),
])
def test_ambiguous_ipv6_hosts_are_refused(spec: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_hosts(spec)


def test_ipv6_in_a_hostfile(tmp_path: Path) -> None:
    hosts = parse_hostfile(_hostfile(tmp_path, b"::1 slots=2\n[fe80::1] slots=3\n[fe80::2]:4\n"))
    assert hosts == [Host("::1", 2), Host("fe80::1", 3), Host("fe80::2", 4)]


@pytest.mark.parametrize("flags", [["-H", ""], ["--hostfile", ""], ["-H", "  "]])
def test_an_empty_host_flag_is_an_error_not_this_host(flags: list[str], script: str) -> None:
    with pytest.raises(ConfigError, match="is empty"):
        cli.build_config(["-np", "2", *flags, sys.executable, script])


def test_horovodrun_empty_hosts_is_an_error_not_localhost(script: str) -> None:
    with pytest.raises(ConfigError, match="-H is empty"):
        horovodrun.translate(["-np", "2", "-H", "", "python", script], environ={})


def test_a_directory_as_the_command_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Popen raised PermissionError with a traceback once the job had started
    assert cli.main(["-np", "1", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err


def test_network_interface_takes_one_name(script: str) -> None:
    # Horovod's list spelling: it was "has no IPv4 address ... pick one of those"
    with pytest.raises(ConfigError, match="give one interface name"):
        cli.build_config(["-np", "2", "-H", "localhost:1,server2:1", "--network-interface", "eth0,lo",
                          sys.executable, script])


def test_a_flag_given_twice_keeps_the_last_value_as_torchrun_and_horovodrun(script: str) -> None:
    # a base command line plus an override: argparse's rule, which both anchors keep
    cfg = cli.build_config(["-np", "2", "-np", "1", "--no-prefix", "--no-prefix", "-x", "A=1",
                            "-x", "B=2", sys.executable, script, "-np", "5"])
    assert len(cfg.placements) == 1 and cfg.extra_env == {"A": "1", "B": "2"}
    assert cfg.command[-2:] == ("-np", "5")  # the script's own -np is its own
    plan = horovodrun.translate(["-np", "4", "-np", "2", "python", "t.py"], environ={})
    assert plan.ringrun_argv[plan.ringrun_argv.index("-np") + 1] == "2"


@pytest.mark.parametrize("argv,environ,fragment", [
    # named stall_timeout / RINGTRAIN_STALL_TIMEOUT / --stall-timeout, none of which the user gave
    (["--stall-check-shutdown-time-seconds", "-4"], {}, "--stall-check-shutdown-time-seconds must be >= 0"),
    # was "--fusion-threshold-mb must be >= 0, got -4.76837e-06"
    ([], {"HOROVOD_FUSION_THRESHOLD": "-5"}, "HOROVOD_FUSION_THRESHOLD must be >= 0, got -5 bytes"),
    ([], {"HOROVOD_START_TIMEOUT": "0"}, "HOROVOD_START_TIMEOUT must be > 0 seconds"),
    ([], {"HOROVOD_GLOO_TIMEOUT_SECONDS": "0"}, "HOROVOD_GLOO_TIMEOUT_SECONDS must be > 0"),
    (["--min-np", "1", "--max-np", "2"], {"HOROVOD_ELASTIC_TIMEOUT": "-1"},
     "HOROVOD_ELASTIC_TIMEOUT must be >= 0 seconds"),
])
def test_horovodrun_errors_name_what_the_user_set(argv: list[str], environ: dict[str, str],
                                                  fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        horovodrun.translate(["-np", "2", *argv, "python", "t.py"], environ=environ)


def test_horovodrun_binary_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "horovod.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    assert horovodrun.main(["-np", "2", "--config-file", str(path), "python", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a text file" in err


@pytest.mark.parametrize("value", [["a"], None, {"x": 1}])
def test_config_file_string_keys_must_be_strings(value: object) -> None:
    # a list became the file name "['a']", an empty key the file name "None"
    with pytest.raises(ConfigError, match="timeline.filename = .* is not a string"):
        config_values({"timeline": {"filename": value}}, "hvd.yaml")
