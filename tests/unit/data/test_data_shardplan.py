"""ShardPlan: shards split across ranks by sample count, deterministic, resumable (also at
another world size)."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.data.order import ShardPlan, Stage
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


def _run(sizes: tuple[int, ...], world: int, batch: int, drop_last: bool, batches: int | None,
         resumed: tuple[tuple[int, int, int], ...] = ()) -> tuple[list[int], int]:
    """(dataset indices every rank reads in its first ``batches`` batches or all of
    them, samples each rank consumed) of one stage of epoch 2."""
    read, position = [], 0
    for r in range(world):
        plan = ShardPlan(sizes, batch, world, r, seed=9, epoch=2, drop_last=drop_last,
                         resumed=resumed)
        ix, k = plan.indexer(), plan.num_batches if batches is None else batches
        read += [i for b in range(min(k, plan.num_batches)) for i in ix(b).tolist()]
        position = plan.position_after(k)
    return read, position


@pytest.mark.parametrize("name", ["uneven", "even", "fewer shards than ranks"])
@pytest.mark.parametrize(("world", "batch", "new_world", "new_batch"),
                         [(2, 4, 3, 4), (3, 4, 2, 4), (4, 3, 1, 5), (1, 4, 4, 2), (2, 3, 2, 5)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_another_world_size_reads_the_rest_once(
        name: str, world: int, batch: int, new_world: int, new_batch: int,
        drop_last: bool) -> None:
    sizes = SIZES[name]
    n = sum(sizes)
    first = ShardPlan(sizes, batch, world, 0, drop_last=drop_last)
    for done in sorted({1, first.num_batches // 2, first.num_batches - 1} - {0}):
        before, position = _run(sizes, world, batch, drop_last, done)
        stage = ((world, batch, position),)
        plans = [ShardPlan(sizes, new_batch, new_world, r, seed=9, epoch=2,
                           drop_last=drop_last, resumed=stage) for r in range(new_world)]
        assert len({p.num_batches for p in plans}) == 1  # every new rank as many batches
        after, _ = _run(sizes, new_world, new_batch, drop_last, None, stage)
        if drop_last:
            assert len(set(before + after)) == len(before + after)  # never a sample twice
            # dropped: the tail of the first stage's stream and of the second's
            assert n - len(before + after) < world * batch + new_world * new_batch
        else:
            assert set(before + after) == set(range(n))  # every sample of the epoch ...
            assert len(before + after) - n < world + new_world  # ... padding aside


def test_a_resumed_stage_keeps_ranks_on_few_shards_and_resumes_again() -> None:
    sizes = tuple([50] * 12)  # 12 shards, 600 samples
    before, position = _run(sizes, 2, 8, False, 10)
    stage1 = ((2, 8, position),)
    for r in range(3):
        plan = ShardPlan(sizes, 8, 3, r, seed=9, epoch=2, resumed=stage1)
        ix = plan.indexer()
        touched = {shard_of(sizes, i) for b in range(plan.num_batches) for i in ix(b).tolist()}
        assert len(touched) <= 12 // 3 + 3  # its share, plus the ends of the runs it joins
    # that stage resumed again, at a third world size, and its rest at the same one
    middle, position2 = _run(sizes, 3, 8, False, 4, stage1)
    stage2 = (*stage1, (3, 8, position2))
    last, _ = _run(sizes, 4, 6, False, None, stage2)
    assert set(before + middle + last) == set(range(600))
    assert len(before + middle + last) - 600 < 2 + 3 + 4
    rest = [ShardPlan(sizes, 6, 4, r, seed=9, epoch=2, resumed=stage2, start=12)
            for r in range(4)]
    full = [ShardPlan(sizes, 6, 4, r, seed=9, epoch=2, resumed=stage2) for r in range(4)]
    for a, b in zip(full, rest, strict=True):  # the same world size: by sample count
        assert [b.indexer()(k).tolist() for k in range(b.num_batches)] == \
            [a.indexer()(k).tolist() for k in range(2, a.num_batches)]
    # a resumed stage's augmentation seeds are its own, not the first stage's again
    assert full[0].batch_seed(0) != ShardPlan(sizes, 6, 4, 0, seed=9, epoch=2).batch_seed(0)


def test_bad_plans_are_clear_errors() -> None:
    with pytest.raises(DataError, match="shards with samples"):
        ShardPlan((0, 0), 4)
    with pytest.raises(DataError, match="rank"):
        ShardPlan((4,), 4, world_size=2, rank=2)
    with pytest.raises(DataError, match="range"):
        ShardPlan((4,), 2, start=5)
    with pytest.raises(DataError, match="consumed 99 samples"):
        ShardPlan((10, 10), 2, resumed=((2, 2, 99),))
    with pytest.raises(DataError, match="left nothing"):
        ShardPlan((10, 10), 2, resumed=((2, 2, 10),))


def _runs_by_sample(plan: ShardPlan) -> list[tuple[int, int]]:
    """(first batch, shard) of each run of one shard, sample by sample (the slow way)."""
    ix, runs, last = plan.indexer(), [], None
    for k in range(plan.num_batches):
        shards, _ = ix.locate(k)
        for i, s in enumerate(shards.tolist()):
            if s != last:
                runs.append(((k * plan.batch_size + i) // plan.batch_size, s))
                last = s
    return runs


@pytest.mark.parametrize("resumed", [(), ((2, 4, 8),), ((2, 4, 8), (3, 4, 4))])
@pytest.mark.parametrize("name", ["uneven", "even", "fewer shards than ranks"])
def test_next_shards_are_the_runs_this_rank_reads_next(name: str,
                                                      resumed: tuple[Stage, ...]) -> None:
    sizes = SIZES[name]
    for world in (1, 2, 3):
        for r in range(world):
            whole = ShardPlan(sizes, 4, world, r, seed=9, epoch=1, resumed=resumed)
            plan = ShardPlan(sizes, 4, world, r, seed=9, epoch=1, resumed=resumed,
                             start=min(4, whole.range_len))
            runs = [(k, s) for k, s in _runs_by_sample(plan) if sizes[s] > 0]
            ix = plan.indexer()
            for k in range(plan.num_batches):
                want = []
                for first, s in runs:
                    if first > k and s not in want:
                        want.append(s)
                got = [s for s in ix.next_shards(k, count=len(sizes)) if sizes[s] > 0]
                assert got == want, (world, r, k)
            if plan.num_batches:  # nothing after the last batch
                assert [s for s in ix.next_shards(plan.num_batches - 1) if sizes[s]] == []
