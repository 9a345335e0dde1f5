"""rt.init() in a worker of a torchrun that ringrun started on each host reads torchrun's
variables, not the ringrun ones it inherited (before: every worker took itself for rank
0 of a 1-process world, and trained alone without a word)."""

from __future__ import annotations

from ringtrain.env import parse_env

RINGRUN_HOST_1 = {  # what ringrun gave torchrun on the second of two hosts
    "RINGTRAIN_RANK": "1", "RINGTRAIN_SIZE": "2", "RINGTRAIN_LOCAL_RANK": "0",
    "RINGTRAIN_LOCAL_SIZE": "1", "RINGTRAIN_RUN_ID": "abc", "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_a_torchrun_worker_under_ringrun_is_torchruns() -> None:
    env = parse_env({**RINGRUN_HOST_1, "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2",
                     "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                     "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "none",
                     "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert env.launcher == "torchrun"
    assert (env.rank, env.size, env.local_rank, env.local_size) == (6, 8, 2, 4)
    assert (env.cross_rank, env.cross_size, env.master_port) == (1, 2, 29400)
    assert env.agent_store and env.store_fd is None


def test_ringruns_own_ranks_stay_ringruns() -> None:
    # ringrun sets RANK / WORLD_SIZE to its own values, so they agree.
    env = parse_env({**RINGRUN_HOST_1, "RANK": "1", "WORLD_SIZE": " 2"})
    assert env.launcher == "ringrun" and (env.rank, env.size) == (1, 2)
    assert parse_env(RINGRUN_HOST_1).launcher == "ringrun"


def test_torchruns_node_count_on_uneven_nodes() -> None:
    # Nodes of 1 and 2 processes: torchrun's GROUP_WORLD_SIZE is 2 on both; the ceiling of
    # WORLD_SIZE / LOCAL_WORLD_SIZE said 3 on the first node's rank.
    first = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
             "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    second = {**first, "RANK": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert [(e.cross_rank, e.cross_size) for e in map(parse_env, (first, second))] == [(0, 2), (1, 2)]
