"""torchrun's TORCHELASTIC_USE_AGENT_STORE is read in torchrun's dialect only (issue: inherited
by ringrun, mpirun or srun from a torchrun worker that started them, it made rank 0 a
client of a store nobody serves, and every rank waited out the rendezvous timeout), and a
torchrun under ringrun with one worker per ringrun rank is read as torchrun's (its own
store, run id and restart count; before, as ringrun's rank with torchrun's port)."""

from __future__ import annotations

import pytest

from ringtrain.env import parse_env

RINGRUN_RANK_0 = {  # what ringrun gives rank 0 of 2 (see launch/job.py worker_env)
    "RINGTRAIN_RANK": "0", "RINGTRAIN_SIZE": "2", "RINGTRAIN_LOCAL_RANK": "0",
    "RINGTRAIN_LOCAL_SIZE": "2", "RINGTRAIN_RUN_ID": "abc", "RINGTRAIN_ATTEMPT": "0",
    "RINGTRAIN_STORE_FD": "3", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "0",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000",
}
OPENMPI_RANK_0 = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000"}
SRUN_RANK_0 = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
               "SLURM_JOB_ID": "7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000"}


@pytest.mark.parametrize("env,launcher", [
    (RINGRUN_RANK_0, "ringrun"), (OPENMPI_RANK_0, "mpirun"), (SRUN_RANK_0, "slurm"),
])
def test_an_inherited_agent_store_flag_is_not_another_launchers(env: dict[str, str], launcher: str) -> None:
    got = parse_env({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert got.launcher == launcher and got.rank == 0
    assert not got.agent_store  # rank 0 serves the store


def test_torchruns_own_workers_keep_the_agent_store() -> None:
    got = parse_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                     "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert got.launcher == "torchrun" and got.agent_store


def test_a_torchrun_worker_with_ringruns_rank_is_torchruns() -> None:
    # ringrun -np 2 sh -c 'torchrun --nnodes 2 --nproc-per-node 1 --node-rank $RINGTRAIN_RANK
    # --master-port 29555 ...': rank and size agree with ringrun's, the rest is torchrun's.
    got = parse_env({**RINGRUN_RANK_0, "MASTER_PORT": "29555", "TORCHELASTIC_RUN_ID": "none",
                     "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
                     "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"})
    assert got.launcher == "torchrun"
    assert (got.rank, got.size, got.local_size, got.cross_size) == (0, 2, 1, 2)
    # torchrun's store and restart count (each restart rendezvouses under its own prefix)
    assert (got.master_port, got.agent_store, got.store_fd) == (29555, True, None)
    assert (got.attempt, got.run_id) == (2, "none")


def test_ringruns_own_rank_stays_ringruns() -> None:
    got = parse_env(RINGRUN_RANK_0)
    assert got.launcher == "ringrun" and got.store_fd == 3 and not got.agent_store
