"""ringrun's flags to a JobConfig, and the rendezvous address choice (pure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch.cli import build_config, build_parser
from ringtrain.launch.hosts import Host, place_ranks
from ringtrain.launch.job import JobConfig, choose_master_addr, worker_env

PY = sys.executable


def test_multi_host_flags_reach_the_config(tmp_path: Path) -> None:
    key = tmp_path / "id"
    key.write_text("k")
    cfg = build_config(["-np", "4", "-H", "a:2,b:2", "-p", "2222", "-i", str(key), "-x", "A=1",
                        "--ssh-option", "UserKnownHostsFile=/kh", "--network-interface", "eth1",
                        "--start-timeout", "9", "--max-restarts", "2", PY, "-c", "pass"])
    assert [p.host for p in cfg.placements] == ["a", "a", "b", "b"]
    assert cfg.ssh.port == 2222 and cfg.ssh.identity_file == str(key)
    assert cfg.ssh.options == ("UserKnownHostsFile=/kh",) and cfg.ssh.connect_timeout == 9
    assert cfg.extra_env == {"A": "1"} and cfg.network_interface == "eth1"
    assert cfg.max_restarts == 2 and cfg.multi_host


def test_network_interface_on_one_host_is_dropped_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = build_config(["-np", "2", "--network-interface", "eth9", PY, "-c", "pass"])
    assert cfg.network_interface is None
    assert any("no effect on a one-host job" in w for w in cfg.warnings)
    assert capsys.readouterr().err == "", "build_config is pure: main prints the warnings"


def test_settings_flags_are_derived_from_the_settings_fields() -> None:
    from ringtrain.settings import Settings, env_name

    cfg = build_config(["-np", "1", "--stall-timeout", "7", "--fusion-mb", "4", "--backend", "gloo",
                        "--no-progress", "--no-observe", "--timeline", "/tmp/t.json", PY])
    assert cfg.settings_env == {
        "RINGTRAIN_STALL_TIMEOUT": "7.0", "RINGTRAIN_FUSION_MB": "4.0", "RINGTRAIN_BACKEND": "gloo",
        "RINGTRAIN_PROGRESS": "0", "RINGTRAIN_OBSERVE": "0", "RINGTRAIN_TIMELINE": "/tmp/t.json"}
    flags = build_parser().format_help()
    for name in Settings.__dataclass_fields__:
        assert name.replace("_", "-") in flags, f"no ringrun flag for setting {name}"
        assert env_name(name) in flags


@pytest.mark.parametrize("argv,fragment", [
    (["-np", "2", "--bogus", PY], "unrecognized arguments: --bogus"),
    # torchrun's flags name what ringrun takes instead
    (["--nproc-per-node", "2", PY], r"--nproc-per-node: ringrun takes the job's total, -np N"),
    (["--nproc_per_node=2", PY], r"--nproc_per_node=2: ringrun takes the job's total, -np N"),
    (["-np", "2", "--nnodes=1", PY], r"ringrun lists the hosts with -H"),
    (["-np", "2", "--standalone", PY], r"needs no rendezvous flag"),
    (["-np", "2", "--rdzv_backend", "c10d", PY], r"ringrun is the job's rendezvous"),
    (["-np", "2", "--master_port", "29500", PY], r"ringrun spells it --master-port PORT"),
    (["-np", "2", "-m", "pkg.train"], r"ringrun -np N python -m MODULE"),
    (["-np", "2", "-H", "localhost:1,127.0.0.1:1", PY], "listed more than once"),
    (["-np", "1", "--start-timeout", "0", PY], "--start-timeout must be > 0"),
    (["-np", "1", "--start-timeout", "nan", PY], "--start-timeout must be > 0"),
    (["-np", "1", "--start-timeout", "inf", PY], "--start-timeout must be > 0"),
    # -x reaches local ranks last and the flag remote ones: one setting, two values
    (["-np", "1", "-x", "RINGTRAIN_FUSION_MB=5", "--fusion-mb", "10", PY],
     "-x RINGTRAIN_FUSION_MB=5 and --fusion-mb both set RINGTRAIN_FUSION_MB; give one of them"),
    (["-np", "1", "-x", "RINGTRAIN_FUSION_MB=abc", PY], "RINGTRAIN_FUSION_MB='abc' is not a valid float"),
    (["-np", "1", "--stall-timeout", "inf", PY], "stall_timeout must be a finite number > 0"),
    (["-np", "1", "--stall-timeout", "nan", PY], "stall_timeout must be a finite number > 0"),
    (["-np", "1", "--fusion-mb", "0", PY], "fusion_mb must be a finite number > 0"),
    (["-np", "1", "--backend", "mpi", PY], "invalid choice"),
    (["-np", "1", "-H", "a", "-i", "/nonexistent/key", PY], "cannot be read"),
    (["-np", "1", "-H", "a", "-p", "0", PY], "not a TCP port"),
    (["-np", "2", "-H", "localhost:1,a:1", "--network-interface", "nope0", PY], "no IPv4 address"),
])
def test_bad_flags_are_one_line_config_errors(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_config(argv)


def _cfg(hosts: str, **kw: object) -> JobConfig:
    spec = [Host(h.split(":")[0], int(h.split(":")[1])) for h in hosts.split(",")]
    return JobConfig(command=("x",), placements=tuple(place_ranks(spec, sum(h.slots for h in spec))),
                     **kw)  # type: ignore[arg-type]


INFO = {"ifaces": {"lo": "127.0.0.1", "eth0": "10.0.0.11", "ib0": "192.168.7.11"},
        "server_addr": "10.0.0.11", "client_addr": "10.0.0.1"}


def test_one_host_job_rendezvouses_on_loopback() -> None:
    assert choose_master_addr(_cfg("localhost:2"), {}) == "127.0.0.1"


def test_remote_rank0_uses_the_address_ssh_reached_it_at() -> None:
    assert choose_master_addr(_cfg("h1:2,h2:2"), {"h1": INFO, "h2": INFO}) == "10.0.0.11"


def test_network_interface_picks_that_address_on_rank0s_host() -> None:
    cfg = _cfg("h1:2,h2:2", network_interface="ib0")
    assert choose_master_addr(cfg, {"h1": INFO, "h2": INFO}) == "192.168.7.11"


def test_missing_interface_on_rank0s_host_is_named() -> None:
    cfg = _cfg("h1:2,h2:2", network_interface="eth7")
    with pytest.raises(ConfigError, match="eth7 does not exist on host h1"):
        choose_master_addr(cfg, {"h1": INFO, "h2": INFO})


def test_local_rank0_with_remote_hosts_uses_the_address_they_see() -> None:
    assert choose_master_addr(_cfg("localhost:1,h2:1"), {"h2": INFO}) == "10.0.0.1"


def test_master_addr_flag_wins() -> None:
    assert choose_master_addr(_cfg("h1:1,h2:1", master_addr="h1.example"), {"h1": INFO}) == "h1.example"


def test_env_contract_for_a_remote_rank() -> None:
    placed = place_ranks([Host("h1", 2), Host("h2", 2)], 4)
    env = worker_env(placed[3], 4, "10.0.0.11", 29500, 2, "run1", {"A": "1"}, set_threads=False,
                     max_restarts=3)
    assert env["RINGTRAIN_RANK"] == env["RANK"] == "3"
    # torchrun's names, which scripts read (a KeyError under ringrun before)
    assert env["GROUP_WORLD_SIZE"] == "2" and env["ROLE_NAME"] == "default"
    assert env["ROLE_RANK"] == "3" and env["ROLE_WORLD_SIZE"] == "4"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["TORCHELASTIC_RUN_ID"] == "run1" and "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert env["RINGTRAIN_LOCAL_RANK"] == env["LOCAL_RANK"] == "1"
    assert env["RINGTRAIN_CROSS_RANK"] == env["GROUP_RANK"] == "1"
    assert env["RINGTRAIN_ATTEMPT"] == "2" and env["RINGTRAIN_RUN_ID"] == "run1"
    assert env["MASTER_ADDR"] == "10.0.0.11" and env["MASTER_PORT"] == "29500"
    assert env["A"] == "1" and "OMP_NUM_THREADS" not in env  # the host agent counts its cores
