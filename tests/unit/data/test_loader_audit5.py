"""Loader audit 5: what a DataLoader script gets, without an error, that the loader
gave differently: streamed samples of another dtype cast into the batch,
``torch.utils.data.get_worker_info()`` that said "main process" inside a worker, every
worker seeded alike before its first batch, numpy complex scalars left as a list, and
the first batch (loaded in halves) refused where the whole batch was collated."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from datahelp import Items, packed_half
from torch.utils.data import default_collate as torch_collate

from ringtrain.data import Loader, get_worker_info
from ringtrain.data.collate import (
    STREAM_MIN_BYTES,
    StreamCollator,
    default_collate,
    fresh_alloc,
    join_halves,
    unpack,
)

ROW = STREAM_MIN_BYTES  # a row of this many values of any dtype is streamed


def _streamed(samples: list[Any]) -> Any:
    collator = StreamCollator(samples[0], len(samples), fresh_alloc)
    for i, s in enumerate(samples):
        collator.put(i, s)
    return collator.result()


@pytest.mark.parametrize("make", [
    lambda i: torch.full((ROW,), i + 0.7) if i % 2 else torch.full((ROW,), i),  # int64, then floats
    lambda i: np.full(ROW, i + 0.7) if i % 2 else np.full(ROW, i),
    lambda i: np.full(ROW, 7, np.uint8) if i else np.zeros(ROW, np.bool_),  # bool, then 7s
    lambda i: np.full(ROW, i + 0.1, np.float64 if i else np.float32),  # float32, then float64
], ids=["tensor-int-then-float", "array-int-then-float", "bool-then-uint8", "f32-then-f64"])
def test_a_streamed_sample_of_a_wider_kind_widens_the_batch_as_torch_stack(make: Any) -> None:
    # Samples of 16 KiB or more were once copied into the batch with any cast (1.7
    # became 1, 7 became True), then refused. The batch has the dtype torch.stack
    # promotes the samples to, as torch's default_collate (DataLoader with
    # num_workers=0) gives it, on every path: list, streamed, loader.
    samples = [make(i) for i in range(4)]
    want = torch_collate(samples)
    for got in (default_collate(samples), _streamed(samples)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with Loader(Items(samples), batch_size=4, shuffle=False, num_workers=0, device="cpu",
                rank=0, world_size=1) as loader:
        got = next(iter(loader))
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_streamed_sample_of_a_narrower_kind_is_cast_as_the_list_path_casts() -> None:
    # float64 into a float64 batch, int32 into an int64 one: a streamed batch is what
    # the list path (and torch's default_collate) gives.
    for first, later in ((np.float64, np.float32), (np.int64, np.int32)):
        samples = [np.full(ROW, i, first if i == 0 else later) for i in range(3)]
        got = _streamed(samples)
        want = default_collate(samples)
        assert got.dtype == want.dtype and torch.equal(got, want)


class _WorkerView:
    """Each sample: what torch's get_worker_info, ringtrain's, and the worker's RNGs say
    (the RNGs as worker_init_fn left them: it stored one draw of each)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int, int, int, int, int]:
        info = torch.utils.data.get_worker_info()
        mine = get_worker_info()
        assert mine is not None
        if info is None:
            return -1, -1, mine.id, mine.seed, *_INIT_DRAWS
        return info.id, info.seed, mine.id, mine.seed, *_INIT_DRAWS


_INIT_DRAWS: tuple[int, int] = (0, 0)


def _draw_at_init(worker_id: int) -> None:
    global _INIT_DRAWS
    _INIT_DRAWS = (random.getrandbits(31), int(torch.randint(2**31, ())))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed_workers", [True, False], ids=["per-batch-seeds", "dataloader-seeds"])
def test_workers_are_dataloader_workers_to_the_dataset(seed_workers: bool) -> None:
    # Before: torch.utils.data.get_worker_info() was None inside a worker, so a dataset
    # written for DataLoader took itself to be in the main process (and seeded its own
    # generator alike in every worker); with per-batch seeds every worker's info.seed
    # was the loader's seed and worker_init_fn found the same RNG state in each worker.
    def batch_of(rank: int) -> list[list[int]]:
        torch.manual_seed(0)
        with Loader(_WorkerView(), batch_size=1, shuffle=False, num_workers=2, device="cpu",
                    rank=rank, world_size=2, seed_workers=seed_workers,
                    worker_init_fn=_draw_at_init, prefetch=2) as loader:
            return [[int(v) for v in b] for b in loader]
    rows = batch_of(0)
    by_worker = {r[0]: r for r in rows}
    assert set(by_worker) == {0, 1}, rows  # torch's info names the worker ...
    for tid, tseed, rid, rseed, _, _ in rows:
        assert (tid, tseed) == (rid, rseed)  # ... as ringtrain's does
    w0, w1 = by_worker[0], by_worker[1]
    assert w0[1] != w1[1]  # each worker its own seed
    assert w0[4:] != w1[4:]  # and its own RNG state when worker_init_fn runs
    if seed_workers:
        # Per-batch seeds are a function of the loader's seed, the rank and the worker:
        # another rank's workers draw apart from this rank's.
        other = batch_of(1)
        assert {r[1] for r in other}.isdisjoint({r[1] for r in rows})


def test_numpy_complex_scalars_become_a_tensor_as_under_dataloader() -> None:
    # Before: a list of numpy scalars (DataLoader: a complex64 tensor).
    samples = [np.complex64(i + 1j) for i in range(3)]
    want = torch_collate(samples)
    for got in (default_collate(samples), _streamed(samples)):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("stream", [False, True], ids=["list", "streamed"])
def test_halves_of_two_dtypes_join_as_the_whole_batch_collates(stream: bool) -> None:
    # The first batch of a fresh loader is loaded in halves by two workers. A second
    # half whose first sample had another dtype (float64 among float32) once failed the
    # batch. The joined batch is torch's default_collate of the whole: float64 here.
    n = ROW if stream else 3
    samples = [np.full(n, i + 0.25, np.float64 if i == 2 else np.float32) for i in range(4)]
    whole = default_collate(samples)
    spec, buf = join_halves(*packed_half(samples[:2], stream), *packed_half(samples[2:], stream))
    got = unpack(spec, buf)
    want = torch_collate(samples)
    assert got.dtype == whole.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(whole, want)
    # Ints, then floats: the batch is float (torch.stack's promotion), in halves too.
    mixed = [np.full(n, i, np.int64) if i < 2 else np.full(n, i + 0.5) for i in range(4)]
    got = unpack(*join_halves(*packed_half(mixed[:2], stream), *packed_half(mixed[2:], stream)))
    want = torch_collate(mixed)
    assert got.dtype == want.dtype and torch.equal(got, want)


def _lines(shard: str) -> Any:
    # An IterableDataset's habit: split by DataLoader worker. The loader splits the
    # shards itself, so inside its workers this must see the whole shard.
    info = torch.utils.data.get_worker_info()
    lines = [f"{shard}{i}" for i in range(4)]
    return iter(lines if info is None else lines[info.id::info.num_workers])


@pytest.mark.timeout(60)
def test_stream_shards_read_whole_shards_in_workers() -> None:
    from ringtrain.data import StreamShards

    def read(workers: int) -> list[str]:
        with Loader(StreamShards(["a", "b", "c"], _lines, sizes=[4, 4, 4]), batch_size=2,
                    shuffle=False, num_workers=workers, device="cpu", rank=0,
                    world_size=1) as loader:
            return [s for b in loader for s in b]
    assert read(2) == read(0) == [f"{s}{i}" for s in "abc" for i in range(4)]
