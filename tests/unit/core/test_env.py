"""Launch-environment detection for every launcher dialect (pure, no processes)."""

from __future__ import annotations

import pytest

from ringtrain.env import expand_slurm_nodelist, parse_env
from ringtrain.errors import LaunchEnvError


def test_no_launcher_is_a_one_process_world() -> None:
    env = parse_env({})
    assert (env.launcher, env.rank, env.size, env.local_rank, env.master_port) == ("none", 0, 1, 0, None)


def test_ringrun_variables() -> None:
    env = parse_env({
        "RINGTRAIN_RANK": "5", "RINGTRAIN_SIZE": "8", "RINGTRAIN_LOCAL_RANK": "1",
        "RINGTRAIN_LOCAL_SIZE": "4", "RINGTRAIN_CROSS_RANK": "1", "RINGTRAIN_CROSS_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RINGTRAIN_ATTEMPT": "2",
        "RINGTRAIN_RUN_ID": "abc", "RINGTRAIN_STORE_FD": "7",
        # torchrun-style names are also set by ringrun; ringrun's own win.
        "RANK": "5", "WORLD_SIZE": "8",
    })
    assert env.launcher == "ringrun"
    assert (env.rank, env.size, env.local_rank, env.local_size) == (5, 8, 1, 4)
    assert (env.cross_rank, env.cross_size, env.attempt, env.run_id, env.store_fd) == (1, 2, 2, "abc", 7)


def test_torchrun_variables() -> None:
    env = parse_env({
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "MASTER_ADDR": "node1", "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "job",
    })
    assert env.launcher == "torchrun"
    assert (env.rank, env.size, env.local_rank, env.local_size) == (3, 4, 1, 2)
    assert (env.cross_rank, env.cross_size, env.master_addr, env.master_port) == (1, 2, "node1", 1234)
    assert env.attempt == 1


def test_openmpi_variables_on_one_host_derive_loopback_and_port() -> None:
    base = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "PMIX_NAMESPACE": "prterun-host-1234@1"}
    a, b = parse_env(base), parse_env({**base, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert a.launcher == "mpirun" and (a.rank, a.size, a.local_rank) == (1, 2, 1)
    assert a.master_addr == "127.0.0.1"
    assert a.master_port == b.master_port and 20000 <= a.master_port < 30000


def test_openmpi_across_hosts_needs_master_addr() -> None:
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR"):
        parse_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                   "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "x"})


def test_slurm_variables() -> None:
    env = parse_env({
        "SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
        "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "991", "SLURM_STEP_NODELIST": "gpu[07-08]",
    })
    assert env.launcher == "slurm"
    assert (env.rank, env.size, env.local_rank, env.local_size) == (6, 8, 2, 4)
    assert (env.cross_rank, env.cross_size, env.master_addr) == (1, 2, "gpu07")
    assert env.master_port is not None


def test_slurm_batch_shell_without_step_is_not_a_rank() -> None:
    assert parse_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "none"


@pytest.mark.parametrize("nodelist,expected", [
    ("a1", ["a1"]),
    ("gpu[01-03,07],login", ["gpu01", "gpu02", "gpu03", "gpu07", "login"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
])
def test_expand_slurm_nodelist(nodelist: str, expected: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == expected


@pytest.mark.parametrize("env,match", [
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "outside the world"),
    ({"WORLD_SIZE": "2"}, "RANK is not"),
    ({"RANK": "0"}, "WORLD_SIZE is not"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "not a TCP port"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1"},
     "local rank"),
    ({"RINGTRAIN_RANK": "0", "RINGTRAIN_SIZE": "2"}, "partial ringrun"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "partial OpenMPI"),
])
def test_inconsistent_environments_are_clear_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(LaunchEnvError, match=match):
        parse_env(env)
