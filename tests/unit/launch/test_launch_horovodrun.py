"""horovodrun's flags -> ringrun's, and Horovod's environment for each rank (pure)."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch import cli
from ringtrain.launch.horovod_env import horovod_env
from ringtrain.launch.horovodrun import DEFAULT_RESET_LIMIT, STOP_FLAGS, check_build_text, translate
from ringtrain.launch.hosts import Host, place_ranks


def _argv(line: str, environ: dict[str, str] | None = None) -> list[str]:
    """ringrun's flags after the stop flags every horovodrun job starts with."""
    argv = translate(line.split(), environ or {}).ringrun_argv
    assert tuple(argv[:len(STOP_FLAGS)]) == STOP_FLAGS, argv
    return argv[len(STOP_FLAGS):]


def test_without_hosts_horovod_runs_np_ranks_on_localhost() -> None:
    assert _argv("-np 8 python train.py") == ["-np", "8", "-H", "localhost:8", "--", "python",
                                               "train.py"]
    # ... which ringrun accepts on any core count (explicit slots are trusted).
    assert len(cli.build_config(_argv("-np 8 true")).placements) == 8


@pytest.mark.parametrize("flags,want", [
    ("-H a:2,b:2", ["-H", "a:2,b:2"]),
    ("--hosts a:2", ["-H", "a:2"]),
    ("-hostfile hf", ["--hostfile", "hf"]),
    ("--hostfile hf", ["--hostfile", "hf"]),
    ("-p 2222", ["-H", "localhost:2", "-p", "2222"]),
    ("--ssh-identity-file k", ["-H", "localhost:2", "-i", "k"]),
    ("--start-timeout 9", ["-H", "localhost:2", "--start-timeout", "9"]),
    ("--network-interface eth1", ["-H", "localhost:2", "--network-interface", "eth1"]),
    ("--network-interfaces eth1", ["-H", "localhost:2", "--network-interface", "eth1"]),
    ("--output-filename logs", ["-H", "localhost:2", "--output-filename", "logs", "--output-tee",
                                "--output-layout", "horovod"]),
    ("--fusion-threshold-mb 64", ["-H", "localhost:2", "--fusion-mb", "64.0",
                                  "-x", f"HOROVOD_FUSION_THRESHOLD={64 << 20}"]),
    ("--fusion-threshold-mb 0", ["-H", "localhost:2", "--fusion-mb", repr(1 / 2**20),
                                 "-x", "HOROVOD_FUSION_THRESHOLD=0"]),
    ("--timeline-filename t.json", ["-H", "localhost:2", "--timeline", "t.json",
                                    "-x", "HOROVOD_TIMELINE=t.json"]),
    ("--stall-check-shutdown-time-seconds 90", ["-H", "localhost:2", "--stall-timeout", "90"]),
    # Below the check time (60 s by default) Horovod never shuts down, with a warning.
    ("--stall-check-shutdown-time-seconds 30", ["-H", "localhost:2"]),
    ("--stall-check-warning-time-seconds 10 --stall-check-shutdown-time-seconds 30",
     ["-H", "localhost:2", "--stall-timeout", "30", "-x", "HOROVOD_STALL_CHECK_TIME_SECONDS=10"]),
    ("--stall-check-shutdown-time-seconds 0", ["-H", "localhost:2"]),   # Horovod's "never"
    ("--gloo", ["-H", "localhost:2"]),
    ("--min-np 2 --max-np 2", ["-H", "localhost:2", "--max-restarts", str(DEFAULT_RESET_LIMIT)]),
    ("--min-np 2 --max-np 2 --reset-limit 5", ["-H", "localhost:2", "--max-restarts", "5"]),
])
def test_flags_translate(flags: str, want: list[str]) -> None:
    assert _argv(f"-np 2 {flags} python t.py") == ["-np", "2", *want, "--", "python", "t.py"]


def test_translated_flags_are_ringruns_own() -> None:
    """Every translation builds a valid ringrun config; settings reach the workers' env."""
    cfg = cli.build_config(_argv("-np 2 --fusion-threshold-mb 0 --timeline-filename /tmp/t.json "
                                 "--stall-check-shutdown-time-seconds 90 true"))
    assert cfg.settings_env == {"RINGTRAIN_FUSION_MB": repr(1 / 2**20),
                                "RINGTRAIN_TIMELINE": "/tmp/t.json", "RINGTRAIN_STALL_TIMEOUT": "90.0"}
    assert cfg.extra_env == {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_TIMELINE": "/tmp/t.json"}


def test_elastic_size_without_np_is_the_fixed_size() -> None:
    assert _argv("--min-np 3 --max-np 3 true")[:2] == ["-np", "3"]


@pytest.mark.parametrize("line,want", [
    ("-np 3 --min-np 2 --max-np 4 true",
     ["-np", "3", "--like-horovod", "--min-np", "2", "--max-np", "4", "--elastic-timeout", "600",
      "-H", "localhost:4", "--", "true"]),
    ("-np 2 --min-np 2 true", ["-np", "2", "--like-horovod", "--min-np", "2", "--elastic-timeout", "600",
                               "-H", "localhost:2", "--", "true"]),
    ("-np 2 --max-np 3 true", ["-np", "2", "--like-horovod", "--min-np", "2", "--max-np", "3",
                               "--elastic-timeout", "600", "-H", "localhost:3", "--", "true"]),
    ("--min-np 2 --max-np 8 --host-discovery-script ./d.sh --reset-limit 4 true",
     ["--like-horovod", "--min-np", "2", "--max-np", "8", "--reset-limit", "4", "--elastic-timeout", "600",
      "--host-discovery-script", "./d.sh", "--", "true"]),
    ("-np 2 --min-np 1 --max-np 2 -H a:1,b:1 true",
     ["-np", "2", "--like-horovod", "--min-np", "1", "--max-np", "2", "--elastic-timeout", "600",
      "-H", "a:1,b:1", "--", "true"]),
])
def test_resizing_flags_become_ringruns_resizable_job(line: str, want: list[str]) -> None:
    """--min-np < --max-np (or a discovery script) is resized in place, not restarted."""
    assert _argv(line) == want


def test_start_timeout_comes_from_horovods_variable() -> None:
    assert "--start-timeout" not in _argv("-np 1 true")
    assert _argv("-np 1 true", {"HOROVOD_START_TIMEOUT": "45"})[4:6] == ["--start-timeout", "45"]
    assert _argv("-np 1 --start-timeout 5 true", {"HOROVOD_START_TIMEOUT": "45"})[5] == "5"


@pytest.mark.parametrize("line,fragment", [
    ("-np 2 --mpi true", "--mpi is not supported"),
    ("-np 2 --jsrun true", "--jsrun is not supported"),
    ("-np 2 --config-file /nonexistent/c.yaml true", "cannot be read"),
    ("--max-np 4 true", "--min-np is needed"),
    ("-np 2 --fusion-threshold-mb -1 true", "must be >= 0"),
    ("-np 2 --fusion-threshold-mb nan true", "must be >= 0"),
    ("-np 2 --fusion-threshold-mb inf true", "must be >= 0"),
    ("-np 2 --gloo --mpi true", "--mpi is not supported"),
    ("-np 2 -H a:1 --hostfile f true", "-H and --hostfile cannot be used together"),
    ("-np 2 --log-level LOUD true", "invalid choice"),
    ("python train.py", "-np is required"),
    ("-np 2 --bogus true", "unrecognized arguments: --bogus"),
])
def test_unsupported_or_wrong_flags_are_one_line_errors(line: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        translate(line.split(), {})


def test_reset_limit_of_a_job_that_is_not_elastic_is_ignored_as_in_horovod() -> None:
    # Before, it became --max-restarts: a failed job restarted where Horovod's ends.
    t = translate("-np 2 --reset-limit 3 true".split(), {})
    assert "--max-restarts" not in t.ringrun_argv
    assert any(w.startswith("--reset-limit applies to an elastic job") for w in t.warnings)


def test_tuning_flags_without_effect_are_warned_not_refused() -> None:
    t = translate("-np 2 --autotune --cycle-time-ms 5 --hierarchical-allreduce --binding-args=x "
                  "--network-interfaces eth1,eth2 true".split(), {})
    assert t.ringrun_argv == [*STOP_FLAGS, "-np", "2", "-H", "localhost:2", "--network-interface", "eth1",
                              "--", "true"]
    assert t.warnings[0] == "--network-interface eth1,eth2: ringtrain uses the first, eth1"
    assert [w.split(" has no effect with ringtrain: ")[0] for w in t.warnings[1:]] == [
        "--cycle-time-ms", "--hierarchical-allreduce", "--autotune", "--binding-args"]


def test_check_build_needs_no_np() -> None:
    t = translate(["--check-build"], {})
    assert t.check_build and t.ringrun_argv == []


@pytest.mark.parametrize("facts,nccl", [
    ({"torch": "2.13.0", "gloo": True, "nccl": True, "cuda": True}, True),
    ({"torch": "2.13.0", "gloo": True, "nccl": True, "cuda": False}, False),  # no GPU, no NCCL ops
])
def test_check_build_is_truthful(facts: dict[str, object], nccl: bool) -> None:
    text = check_build_text(facts)
    assert "[X] PyTorch" in text and "[X] Gloo" in text and "[ ] MPI" in text
    assert ("[X] NCCL" if nccl else "[ ] NCCL") in text


def test_check_build_without_torch_claims_nothing() -> None:
    text = check_build_text({"ringtrain": "0.1"})
    assert "[X]" not in text


def test_horovod_env_on_even_hosts_matches_ringtrains() -> None:
    placed = place_ranks([Host("a", 2), Host("b", 2)], 4)
    env = horovod_env(placed)
    for p in placed:
        e = env[p.rank]
        assert (e["HOROVOD_RANK"], e["HOROVOD_SIZE"], e["HOROVOD_HOSTNAME"]) == (str(p.rank), "4", p.host)
        assert (e["HOROVOD_LOCAL_RANK"], e["HOROVOD_LOCAL_SIZE"]) == (str(p.local_rank), "2")
        assert (e["HOROVOD_CROSS_RANK"], e["HOROVOD_CROSS_SIZE"]) == (str(p.cross_rank), str(p.cross_size))


def test_horovod_cross_size_counts_hosts_with_that_local_rank() -> None:
    # -H a:2,b:1: local rank 0 exists on a and b, local rank 1 only on a (Horovod's cross
    # communicator joins the ranks of one local rank).
    env = horovod_env(place_ranks([Host("a", 2), Host("b", 1)], 3))
    assert [(env[r]["HOROVOD_CROSS_RANK"], env[r]["HOROVOD_CROSS_SIZE"]) for r in range(3)] == [
        ("0", "2"), ("0", "1"), ("1", "2")]
