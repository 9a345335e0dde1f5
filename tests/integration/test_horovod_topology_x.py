"""ringtrain.horovod's answers about the job's layout, against Horovod's controllers, on
hosts with different rank counts: ``cross_rank``/``cross_size`` (the ranks with this
rank's local rank, one per host) and ``is_homogeneous`` (the same answer on every rank);
and ``ProcessSet.rank()`` on a rank outside the set (Horovod's ValueError). One 3-rank
world, laid out as torchrun describes hosts a:1 and b:2, runs every scenario. Each test
failed before its fix (the comment says how)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from ringtest import error_of, run_world

#: rank -> (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK): host a runs rank 0, host b ranks 1, 2.
LAYOUT = {0: (0, 1, 0), 1: (0, 2, 1), 2: (1, 2, 1)}


def _world() -> dict[str, Any]:
    local_rank, local_size, node = LAYOUT[int(os.environ["RANK"])]
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size), GROUP_RANK=str(node))
    import ringtrain.horovod as hvd

    hvd.init()
    pair = hvd.add_process_set([0, 1])
    out = {
        "layout": (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()),
        "pair_rank": error_of(pair.rank) or pair.rank(),
        "pair_included": pair.included(),
    }
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 3, init=False, timeout=90)


@pytest.mark.timeout(120)
def test_cross_rank_size_and_homogeneity_are_horovods_on_uneven_hosts(world: list[dict[str, Any]]) -> None:
    # Horovod (hosts a:1, b:2): local rank 0 is on both hosts (cross size 2, ranks 0 and
    # 1), local rank 1 on b only (cross size 1); not homogeneous, on every rank. Before:
    # rank 0 said cross size 3 and homogeneous (1 rank x 3 "hosts" = the job's size),
    # rank 2 cross rank 1 of 2.
    assert [o["layout"] for o in world] == [(0, 1, 0, 2, False), (0, 2, 1, 2, False), (1, 2, 0, 1, False)]


@pytest.mark.timeout(120)
def test_process_set_rank_outside_the_set_is_a_value_error(world: list[dict[str, Any]]) -> None:
    # Before: -1, which a script indexing by it (shards[ps.rank()]) took as the last one.
    assert [o["pair_rank"] for o in world[:2]] == [0, 1]
    kind, text = world[2]["pair_rank"]
    assert kind == "ConfigError" and "rank 2 is not part of" in text, world[2]  # a ValueError
    assert [o["pair_included"] for o in world] == [True, True, False]
