"""Every flag of Horovod 0.28.1's horovodrun, its --config-file and its HOROVOD_* variables
(pure: translation to ringrun's command line, no processes)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch import cli
from ringtrain.launch.elastic.worlds import Blacklist
from ringtrain.launch.horovod_flags import FLAGS, markdown_table
from ringtrain.launch.horovodrun import STOP_FLAGS, translate
from ringtrain.launch.output import OutputSink

ROOT = Path(__file__).resolve().parents[3]

#: The option strings of Horovod 0.28.1's ``horovodrun --help`` (horovod/runner/launch.py
#: at v0.28.1), each with a value of the kind it takes: the spec this file checks against.
HOROVOD_0281 = {
    "-v": None, "--version": None, "-np": "2", "--num-proc": "2", "-cb": None, "--check-build": None,
    "--disable-cache": None, "--start-timeout": "30", "--network-interfaces": "lo",
    "--network-interface": "lo", "--output-filename": "logs", "--verbose": None,
    "--config-file": "CONFIG", "-p": "22", "--ssh-port": "22", "-i": "KEY",
    "--ssh-identity-file": "KEY", "--fusion-threshold-mb": "32", "--cycle-time-ms": "5",
    "--cache-capacity": "1024", "--hierarchical-allreduce": None, "--no-hierarchical-allreduce": None,
    "--hierarchical-allgather": None, "--no-hierarchical-allgather": None, "--torus-allreduce": None,
    "--no-torus-allreduce": None, "--autotune": None, "--no-autotune": None,
    "--autotune-log-file": "at.csv", "--autotune-warmup-samples": "3",
    "--autotune-steps-per-sample": "10", "--autotune-bayes-opt-max-samples": "20",
    "--autotune-gaussian-process-noise": "0.8", "--min-np": "2", "--min-num-proc": "2",
    "--max-np": "4", "--max-num-proc": "4", "--slots-per-host": "2", "--elastic-timeout": "60",
    "--reset-limit": "3", "--blacklist-cooldown-range": "10 100", "--timeline-filename": "tl.json",
    "--timeline-mark-cycles": None, "--no-timeline-mark-cycles": None, "--no-stall-check": None,
    "--stall-check": None, "--stall-check-warning-time-seconds": "60",
    "--stall-check-shutdown-time-seconds": "120", "--mpi-threads-disable": None,
    "--no-mpi-threads-disable": None, "--mpi-args": "=--map-by=x", "--tcp": None,
    "--binding-args": "x", "--num-nccl-streams": "2", "--thread-affinity": "1",
    "--gloo-timeout-seconds": "30", "--log-level": "DEBUG", "--log-with-timestamp": None,
    "--log-without-timestamp": None, "-prefix-timestamp": None, "--prefix-output-with-timestamp": None,
    "--log-hide-timestamp": None, "--no-log-hide-timestamp": None, "-H": "localhost:2",
    "--hosts": "localhost:2", "-hostfile": "HOSTFILE", "--hostfile": "HOSTFILE",
    "--host-discovery-script": "SCRIPT", "--gloo": None, "--mpi": None, "--jsrun": None,
}
_REFUSED = {"--mpi", "--jsrun"}


def _line(option: str, value: str | None, tmp: Path) -> list[str]:
    values = {"CONFIG": str(tmp / "c.yaml"), "KEY": str(tmp / "key"), "HOSTFILE": str(tmp / "hosts"),
              "SCRIPT": str(tmp / "d.sh")}
    (tmp / "c.yaml").write_text("params: {cycle_time_ms: 2}\n")
    (tmp / "key").write_text("")
    (tmp / "hosts").write_text("localhost slots=2\n")
    (tmp / "d.sh").write_text("#!/bin/sh\necho localhost:2\n")
    (tmp / "d.sh").chmod(0o755)
    if value is not None and value.startswith("="):  # (Horovod's advice for values starting with -)
        args = [option + value]
    else:
        args = [option] + ([] if value is None else [values.get(value, v) for v in value.split()])
    np = [] if option in ("-np", "--num-proc", "--min-np", "--min-num-proc") else ["-np", "2"]
    return np + args + ["true"]


@pytest.mark.parametrize("option", sorted(HOROVOD_0281))
def test_every_horovod_flag_parses(option: str, tmp_path: Path) -> None:
    """Each flag is accepted (mapped, or one line saying it has no effect); --mpi and
    --jsrun are one-line errors naming the alternative; what comes out is a ringrun
    command line that ringrun itself accepts."""
    line = _line(option, HOROVOD_0281[option], tmp_path)
    if option in _REFUSED:
        with pytest.raises(ConfigError, match=f"{option} is not supported: .*(drop|list the hosts)"):
            translate(line, {})
        return
    t = translate(line, {})
    if t.version or t.check_build:
        return
    for warning in t.warnings:
        assert "\n" not in warning
    cli.build_config(t.ringrun_argv)


def test_the_flag_table_has_every_horovod_flag_and_no_other() -> None:
    spelled = {n for f in FLAGS for n in (*f.names, *f.inverse)}
    assert spelled == set(HOROVOD_0281)
    assert {f.names[0] for f in FLAGS if f.kind == "refused"} == _REFUSED


def test_docs_migrate_table_is_the_generated_one() -> None:
    text = (ROOT / "docs" / "migrate.md").read_text()
    m = re.search(r"<!-- horovodrun-flags -->\n(.*?)<!-- /horovodrun-flags -->", text, re.S)
    assert m is not None, "docs/migrate.md lost its generated flag table markers"
    assert m.group(1) == markdown_table(), "regenerate: python -m ringtrain.launch.horovod_flags"


@pytest.mark.parametrize("flags,want", [
    ("--log-level TRACE", ["--log-level", "debug"]),
    ("--log-level FATAL", ["--log-level", "critical"]),
    ("--log-with-timestamp", ["--log-time"]),
    ("--no-log-hide-timestamp", ["--log-time"]),
    ("--log-hide-timestamp", []),
    ("-prefix-timestamp", ["--timestamp-output"]),
    ("--gloo-timeout-seconds 45", ["--init-timeout", "45"]),
    ("--no-stall-check --stall-check-shutdown-time-seconds 9",
     ["--stall-timeout", "31536000", "-x", "HOROVOD_STALL_CHECK_DISABLE=1"]),
    ("--stall-check-warning-time-seconds 5", ["-x", "HOROVOD_STALL_CHECK_TIME_SECONDS=5"]),
    ("--stall-check-shutdown-time-seconds 0", []),  # Horovod's "never", the drop-in's default
    ("--stall-check", []),
    ("--tcp", ["-x", "NCCL_IB_DISABLE=1"]),
    ("--timeline-filename t.json --timeline-mark-cycles",
     ["--timeline", "t.json", "-x", "HOROVOD_TIMELINE=t.json", "-x", "HOROVOD_TIMELINE_MARK_CYCLES=1"]),
])
def test_mapped_flags(flags: str, want: list[str]) -> None:
    argv = translate(f"-np 2 {flags} true".split(), {}).ringrun_argv
    assert argv == [*STOP_FLAGS, "-np", "2", "-H", "localhost:2", *want, "--", "true"]
    cfg = cli.build_config(argv)
    if "--log-level" in want:
        assert cfg.settings_env["RINGTRAIN_LOG_LEVEL"] == want[1]
    if "--timestamp-output" in want:
        assert cfg.timestamp_output


def test_elastic_flags_reach_ringruns_resizable_job() -> None:
    argv = translate("-np 2 --min-num-proc 2 -H localhost:2,127.0.0.1:2 --elastic-timeout 5 "
                     "--blacklist-cooldown-range 1 2 --reset-limit 3 true".split(), {}).ringrun_argv
    e = cli.build_config(argv).elastic
    assert e is not None and e.like_horovod and (e.min_np, e.max_np, e.np) == (2, 4, 2)
    assert (e.elastic_timeout, e.cooldown_range, e.reset_limit) == (5.0, (1.0, 2.0), 3)
    assert [h.name for h in e.hosts] == ["localhost", "127.0.0.1"]  # two hosts, Horovod's way
    # Horovod's -np below --min-np: the first world waits for --min-np slots
    e = cli.build_config(translate("-np 2 --min-np 4 -H localhost:2,127.0.0.1:2 true".split(),
                                   {}).ringrun_argv).elastic
    assert e is not None and (e.np, e.min_np) == (2, 4)


def test_config_file_fills_what_the_command_line_does_not_give(tmp_path: Path) -> None:
    cfg = tmp_path / "hvd.yaml"
    cfg.write_text("controller: gloo\n"
                   "params: {fusion_threshold_mb: 16, cycle_time_ms: 3, hierarchical_allreduce: false}\n"
                   "autotune: {enabled: true, warmup_samples: 2}\n"
                   "timeline: {filename: tl.json, mark_cycles: true}\n"
                   "stall_check: {enabled: true, shutdown_time_seconds: 90}\n"
                   "library_options: {gloo_timeout_seconds: 40, num_nccl_streams: 2}\n"
                   "logging: {level: INFO, with_timestamp: true}\n"
                   "extras: {x: 1}\n")
    t = translate(f"-np 2 --config-file {cfg} --fusion-threshold-mb 8 true".split(), {})
    argv = t.ringrun_argv
    assert argv[argv.index("--fusion-mb") + 1] == "8.0"  # the command line wins
    assert argv[argv.index("--timeline") + 1] == "tl.json" and "HOROVOD_TIMELINE_MARK_CYCLES=1" in argv
    assert argv[argv.index("--stall-timeout") + 1] == "90"
    assert argv[argv.index("--init-timeout") + 1] == "40"
    assert argv[argv.index("--log-level") + 1] == "info" and "--log-time" in argv
    said = "\n".join(t.warnings)
    assert f"{cfg}: extras: unknown section" in said
    for key in ("params.cycle_time_ms", "params.hierarchical_allreduce", "autotune.enabled",
                "autotune.warmup_samples", "library_options.num_nccl_streams"):
        assert f"{cfg}: {key.split('.')[0]}.{key.split('.')[1]} has no effect with ringtrain" in said, key
    cli.build_config(argv)
    cfg.write_text("stall_check: {enabled: false}\n")
    assert "31536000" in translate(f"-np 2 --config-file {cfg} true".split(), {}).ringrun_argv


@pytest.mark.parametrize("text,fragment", [
    ("params: {fusion_threshold_mb: lots}\n", "params.fusion_threshold_mb = 'lots' is not a number"),
    ("params: {cache_capacity: 1.5}\n", "is not a whole number"),
    ("logging: {level: LOUD}\n", "is not one of TRACE"),
    ("controller: nccl\n", "the controller is gloo"),
    ("controller: mpi\n", "is not supported"),
    ("params: [1, 2]\n", "must be a mapping"),
    ("- a\n- b\n", "is not a mapping of sections"),
    ("params: {a: [\n", "is not valid YAML at line"),
])
def test_bad_config_files_are_one_line_errors(text: str, fragment: str, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(fragment)) as err:
        translate(f"-np 2 --config-file {cfg} true".split(), {})
    assert "\n" not in str(err.value)


def test_horovod_variables_act_like_their_flags() -> None:
    env = {"HOROVOD_FUSION_THRESHOLD": str(32 << 20), "HOROVOD_TIMELINE": "v.json",
           "HOROVOD_LOG_LEVEL": "debug", "HOROVOD_LOG_HIDE_TIME": "0", "HOROVOD_STALL_CHECK_DISABLE": "1",
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "50", "HOROVOD_CYCLE_TIME": "2", "HOROVOD_ELASTIC_TIMEOUT": "7"}
    t = translate("-np 2 --min-np 1 true".split(), env)
    argv = t.ringrun_argv
    assert argv[argv.index("--fusion-mb") + 1] == "32.0" and argv[argv.index("--timeline") + 1] == "v.json"
    assert argv[argv.index("--log-level") + 1] == "debug" and "--log-time" in argv
    assert argv[argv.index("--stall-timeout") + 1] == "31536000"
    assert argv[argv.index("--init-timeout") + 1] == "50"
    assert argv[argv.index("--elastic-timeout") + 1] == "7"
    assert t.warnings == ["HOROVOD_CYCLE_TIME has no effect with ringtrain: ringtrain starts an exchange "
                          "as soon as every rank has submitted it (no cycle to wait for)"]
    # a flag on the command line wins over the variable
    argv = translate("-np 2 --log-level ERROR true".split(), env).ringrun_argv
    assert argv[argv.index("--log-level") + 1] == "error"
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD='big' is not a whole number of bytes"):
        translate("-np 2 true".split(), {"HOROVOD_FUSION_THRESHOLD": "big"})


# -- ringrun's side of the elastic flags ------------------------------------------------------


def test_ringrun_elastic_flags() -> None:
    e = cli.build_config("-H localhost:2,127.0.0.1:2 --min-np 2 --like-horovod --elastic-timeout 3 "
                         "--blacklist-cooldown-range 5 50 true".split()).elastic
    assert e is not None and (e.elastic_timeout, e.cooldown_range, e.like_horovod) == (3.0, (5.0, 50.0), True)
    # without Horovod's rules, two names of this machine are one host listed twice
    with pytest.raises(ConfigError, match="listed more than once"):
        cli.build_config("-H localhost:2,127.0.0.1:2 --min-np 2 true".split())


@pytest.mark.parametrize("line,fragment", [
    ("-np 2 --elastic-timeout 5 true", "--elastic-timeout applies to a resizable job"),
    ("-np 2 --like-horovod true", "--like-horovod applies to a resizable job"),
    ("-H a:1,b:1 --min-np 1 --blacklist-cooldown-range 5 1 true", "0 < MIN <= MAX"),
    ("-H a:1,b:1 --min-np 1 --elastic-timeout -1 true", "--elastic-timeout must be >= 0"),
    ("-H a:1,b:1 --min-np 1 --slots-per-host 0 true",
     "--slots-per-host applies to the hosts a --host-discovery-script prints"),
    ("--host-discovery-script /bin/true --min-np 1 --slots-per-host 0 true", "--slots-per-host must be >= 1"),
    ("-np 2 -H a:1,b:1 --slots-per-host 2 true", "--slots-per-host applies to the hosts a --host-discovery-script"),
    ("-H a:1,b:1 --min-np 1 --elastic-timeout nan true", "--elastic-timeout must be >= 0"),
])
def test_ringrun_bad_elastic_flags(line: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        cli.build_config(line.split())


def test_cooldown_doubles_with_each_failure_within_the_range() -> None:
    bl = Blacklist(cooldown_range=(10.0, 100.0), rng=random.Random(1))
    waits = [bl.add("h", now=0.0) for _ in range(6)]
    assert 10 <= waits[0] <= 20 and 20 <= waits[1] <= 30 and 40 <= waits[2] <= 50
    assert waits[4:] == [100.0, 100.0]  # capped at MAX
    assert bl.failures("h") == 6
    assert bl.observe(["h"], now=99.0) == [] and bl.observe(["h"], now=100.0) == ["h"]


def test_timestamped_output_lines() -> None:
    import io

    out = io.BytesIO()
    sink = OutputSink(None, True, stream=out, timestamp=True)
    sink.write(1, b"hello\n", None)
    line = out.getvalue().decode()
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}\[1\] hello\n", line), line


def test_tee_writes_the_file_and_the_terminal(tmp_path: Path) -> None:
    """--output-tee (horovodrun's --output-filename): the file gets the bytes as written,
    the terminal the [rank]-prefixed line; without it only the file."""
    import io

    for tee in (True, False):
        out = io.BytesIO()
        sink = OutputSink(str(tmp_path / str(tee)), True, stream=out, tee=tee)
        file = sink.open_for(1, 0)
        sink.write(1, b"hello\n", file)
        sink.close(file)
        assert (tmp_path / str(tee) / "rank.1.log").read_bytes() == b"hello\n"
        assert out.getvalue() == (b"[1] hello\n" if tee else b"")


def test_output_tee_without_a_directory_is_one_error() -> None:
    with pytest.raises(ConfigError, match="--output-tee .* add --output-filename DIR"):
        cli.build_config(["-np", "1", "--output-tee", "true"])
