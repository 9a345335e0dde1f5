"""ShardPlan: shards split across ranks by sample count, deterministic, resumable."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.data.order import ShardPlan
from ringtrain.errors import DataError

SIZES = {
    "even": (10, 10, 10, 10, 10, 10),
    "uneven": (7, 1, 12, 5, 9, 0, 3),  # one empty shard, sizes all different
    "fewer shards than ranks": (40, 3),
    "one shard": (23,),
}


def epoch(sizes: tuple[int, ...], world: int, batch: int, drop_last: bool = False,
          **kw: object) -> list[list[list[int]]]:
    """Dataset indices of every batch of every rank."""
    out = []
    for r in range(world):
        plan = ShardPlan(sizes, batch, world, r, drop_last=drop_last, **kw)  # type: ignore[arg-type]
        ix = plan.indexer()
        out.append([ix(k).tolist() for k in range(plan.num_batches)])
    return out


def shard_of(sizes: tuple[int, ...], index: int) -> int:
    return int(np.searchsorted(np.cumsum(sizes), index, side="right"))


@pytest.mark.parametrize("name", list(SIZES))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_batches_no_duplicates_and_no_drops(name: str, world: int,
                                                           drop_last: bool) -> None:
    sizes, batch = SIZES[name], 4
    n = sum(sizes)
    if drop_last and n // world < batch:
        pytest.skip("no full batch per rank")
    per_rank = epoch(sizes, world, batch, drop_last, seed=3, epoch=1)
    assert len({len(b) for b in per_rank}) == 1  # the same number of batches everywhere
    flat = [i for rank in per_rank for b in rank for i in b]
    if drop_last:
        assert len(set(flat)) == len(flat)  # never a sample twice
        assert all(len(b) == batch for rank in per_rank for b in rank)
        assert n - len(flat) < world * batch  # only the tail that fills no batch per rank
    else:
        assert set(flat) == set(range(n))  # every sample ...
        assert len(flat) - n < world  # ... and fewer than `world` padded repeats


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_reads_few_shards(world: int) -> None:
    sizes = tuple([50] * 12)  # 12 shards
    for rank in epoch(sizes, world, 8, seed=1):
        touched = {shard_of(sizes, i) for b in rank for i in b}
        # its share of whole shards, two partial ones at its ends, one for the padding
        assert len(touched) <= -(-12 // world) + 2


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    sizes = SIZES["uneven"]
    assert epoch(sizes, 2, 4, seed=5, epoch=3) == epoch(sizes, 2, 4, seed=5, epoch=3)
    assert epoch(sizes, 2, 4, seed=5, epoch=3) != epoch(sizes, 2, 4, seed=5, epoch=4)
    assert epoch(sizes, 2, 4, seed=5, epoch=3) != epoch(sizes, 2, 4, seed=6, epoch=3)
    plain = epoch(sizes, 1, 4, shuffle=False)[0]
    assert [i for b in plain for i in b] == list(range(sum(sizes)))


def test_shuffle_permutes_shards_and_samples_within_them() -> None:
    sizes = tuple([16] * 8)
    batches = epoch(sizes, 1, 16, seed=2)[0]
    shards = [shard_of(sizes, b[0]) for b in batches]
    assert sorted(shards) == list(range(8)) and shards != list(range(8))
    for b in batches:  # a batch of one shard's size lies in that shard, shuffled
        assert len({shard_of(sizes, i) for i in b}) == 1 and b != sorted(b)
    in_order = epoch(sizes, 1, 16, seed=2, shuffle_within=False)[0]
    assert all(b == sorted(b) for b in in_order)
    assert [shard_of(sizes, b[0]) for b in in_order] == shards  # same shard order


@pytest.mark.parametrize("done", [0, 1, 3, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_from_a_sample_count_continues_exactly(done: int, drop_last: bool) -> None:
    sizes, batch, world = SIZES["uneven"], 3, 2
    for r in range(world):
        full = ShardPlan(sizes, batch, world, r, seed=9, epoch=2, drop_last=drop_last)
        if done > full.num_batches:
            continue
        rest = ShardPlan(sizes, batch, world, r, seed=9, epoch=2, drop_last=drop_last,
                         start=full.position_after(done))
        a, b = full.indexer(), rest.indexer()
        assert rest.num_batches == full.num_batches - done
        assert [b(k).tolist() for k in range(rest.num_batches)] == \
            [a(k).tolist() for k in range(done, full.num_batches)]
        # augmentation seeds follow the sample position, not the batch number
        assert [rest.batch_seed(k) for k in range(rest.num_batches)] == \
            [full.batch_seed(k) for k in range(done, full.num_batches)]


def test_bad_plans_are_clear_errors() -> None:
    with pytest.raises(DataError, match="shards with samples"):
        ShardPlan((0, 0), 4)
    with pytest.raises(DataError, match="rank"):
        ShardPlan((4,), 4, world_size=2, rank=2)
    with pytest.raises(DataError, match="range"):
        ShardPlan((4,), 2, start=5)
