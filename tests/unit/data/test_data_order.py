"""Sample order and sharding: pure functions, no processes."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from ringtrain.data.order import BatchIndexer, EpochPlan, FeistelPermutation, batch_seed, epoch_batches
from ringtrain.errors import DataError


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 1024, 1025, 65_537])
def test_permutation_is_a_bijection(n: int) -> None:
    out = FeistelPermutation(n, seed=3, epoch=1)(np.arange(n))
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))


def test_permutation_depends_only_on_seed_and_epoch() -> None:
    pos = np.arange(10_000)
    a = FeistelPermutation(10_000, 7, 2)(pos)
    assert np.array_equal(a, FeistelPermutation(10_000, 7, 2)(pos))
    assert not np.array_equal(a, FeistelPermutation(10_000, 7, 3)(pos))
    assert not np.array_equal(a, FeistelPermutation(10_000, 8, 2)(pos))
    assert np.mean(a == pos) < 0.01  # actually shuffled


def test_permutation_looks_uniform() -> None:
    # Where does sample 0 land over many epochs? Roughly uniform over 10 buckets.
    n = 1000
    where = [int(np.flatnonzero(FeistelPermutation(n, 0, e)(np.arange(n)) == 0)[0])
             for e in range(400)]
    counts = np.bincount(np.asarray(where) // 100, minlength=10)
    assert counts.min() > 15 and counts.max() < 75


def _shards(n: int, b: int, w: int, drop_last: bool, shuffle: bool = True, epoch: int = 0,
            start: int = 0) -> list[list[np.ndarray]]:
    plans = [EpochPlan(n, b, w, r, shuffle, 5, epoch, drop_last, start) for r in range(w)]
    return [[p.batch_indices(k) for k in range(p.num_batches)] for p in plans]


@pytest.mark.parametrize("n,b,w", [(100, 7, 1), (100, 7, 3), (1000, 32, 4), (10, 4, 3),
                                   (5, 8, 2), (257, 256, 1), (1, 1, 1), (3, 1, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_disjoint_covering_shards(n: int, b: int, w: int, drop_last: bool) -> None:
    if drop_last and epoch_batches(n, b, w, True) == 0:
        pytest.skip("no full batch: the loader refuses this configuration")
    shards = _shards(n, b, w, drop_last)
    counts = {len(s) for s in shards}
    assert counts == {epoch_batches(n, b, w, drop_last)}  # same number of batches on every rank
    sizes = [[len(x) for x in s] for s in shards]
    assert all(sz == sizes[0] for sz in sizes)  # and the same batch sizes
    everything = np.concatenate([np.concatenate(s) for s in shards])
    if drop_last:
        assert len(np.unique(everything)) == len(everything)  # disjoint
        assert len(everything) > n - w * b  # only the tail is dropped
    else:
        assert set(everything.tolist()) == set(range(n))  # full coverage
        assert len(everything) - n < w  # padding is less than one sample per rank
        # the first n positions (before padding) are disjoint
        per_rank = -(-n // w)
        real = [np.concatenate(s)[: per_rank - (1 if r >= n - (per_rank - 1) * w else 0)]
                for r, s in enumerate(shards)]
        flat = np.concatenate(real)
        assert len(np.unique(flat)) == len(flat) == n


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_from_position_continues_exactly(shuffle: bool) -> None:
    n, b, w = 1003, 10, 3
    for r in range(w):
        full = EpochPlan(n, b, w, r, shuffle, 1, 4)
        for k in (0, 1, 17, full.num_batches - 1):
            resumed = EpochPlan(n, b, w, r, shuffle, 1, 4, start=full.position_after(k))
            assert resumed.num_batches == full.num_batches - k
            for j in range(resumed.num_batches):
                assert np.array_equal(resumed.batch_indices(j), full.batch_indices(k + j))


def test_resume_with_another_world_size_covers_the_rest() -> None:
    n, b = 1000, 8
    before = EpochPlan(n, b, 4, 0, True, 0, 0)
    pos = before.position_after(10)
    seen = np.concatenate([EpochPlan(n, b, 4, r, True, 0, 0).batch_indices(k)
                           for r in range(4) for k in range(10)])
    rest = np.concatenate([EpochPlan(n, b, 3, r, True, 0, 0, start=pos).batch_indices(k)
                           for r in range(3)
                           for k in range(EpochPlan(n, b, 3, r, True, 0, 0, start=pos).num_batches)])
    assert set(seen.tolist()) | set(rest.tolist()) == set(range(n))
    assert not set(seen.tolist()) & set(rest[: n - len(seen)].tolist())


def test_batch_indexer_matches_plan() -> None:
    plan = EpochPlan(100_003, 64, 3, 2, True, 9, 1)
    ix = BatchIndexer(plan, chunk_samples=1000)
    perm = plan.permutation()
    for k in (0, 1, 15, 16, 500, plan.num_batches - 1, 3):
        assert np.array_equal(ix(k), plan.batch_indices(k, perm))
    with pytest.raises(IndexError):
        ix(plan.num_batches)


def test_ten_million_samples_cost_constant_memory_and_time() -> None:
    n = 10_000_000
    early = EpochPlan(n, 256, 2, 1, True, 0, 3, start=10)
    late = EpochPlan(n, 256, 2, 1, True, 0, 3, start=9_000_000)
    tracemalloc.start()
    t0 = time.perf_counter()
    BatchIndexer(early)(0)
    t1 = time.perf_counter()
    BatchIndexer(late)(0)
    t2 = time.perf_counter()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 << 20, f"order of a 10M epoch used {peak / 2**20:.1f} MiB"
    assert (t2 - t1) < 10 * (t1 - t0) + 0.05  # resuming late costs what resuming early does


@pytest.mark.parametrize("kwargs", [dict(num_samples=0), dict(batch_size=0), dict(rank=2),
                                    dict(world_size=0), dict(seed=-1), dict(start=101)])
def test_plan_rejects_bad_arguments(kwargs: dict) -> None:
    base = dict(num_samples=100, batch_size=10, world_size=2, rank=0)
    with pytest.raises(DataError):
        EpochPlan(**{**base, **kwargs})


def test_batch_seed_is_deterministic_and_distinct() -> None:
    seeds = {batch_seed(0, e, r, p) for e in range(3) for r in range(3) for p in (0, 256, 512)}
    assert len(seeds) == 27
    assert batch_seed(1, 2, 3, 4) == batch_seed(1, 2, 3, 4)
    assert all(0 <= s < 2**63 for s in seeds)
