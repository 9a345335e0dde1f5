"""Sampling audit: each sample once per epoch over the ranks, as DistributedSampler +
DataLoader count them; a job launched with several processes that never joined (each
of them read the whole dataset, without a word); a ``StreamShards`` size smaller than
its shard (the shard's later samples were never read, without a word); a loop whose
pass a new ``iter(loader)`` or ``load_state_dict`` ended (it stopped as if the epoch
were over)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
from torch.utils.data import DataLoader, DistributedSampler

import ringtrain.data.loader as loader_module
from ringtrain.data import Loader, StreamShards
from ringtrain.errors import DataError


class Numbers:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _rank_batches(n: int, world: int, batch: int, drop_last: bool) -> list[list[int]]:
    """Each rank's samples of one epoch, as lists of batch sizes and samples."""
    out = []
    for rank in range(world):
        loader = Loader(Numbers(n), batch_size=batch, seed=4, num_workers=0, device="cpu",
                        drop_last=drop_last, rank=rank, world_size=world)
        loader.set_epoch(2)
        batches = [b.tolist() for b in loader]
        assert len(batches) == len(loader)
        out.append(batches)
    return out


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "world", "batch"), [
    (1, 4, 2), (3, 8, 1), (13, 3, 4), (17, 2, 32), (31, 4, 5), (64, 8, 3)])
def test_every_sample_once_per_epoch_and_distributed_samplers_counts(
        n: int, world: int, batch: int, drop_last: bool) -> None:
    want = []  # DistributedSampler(drop_last) + DataLoader(drop_last): batches per rank
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, drop_last=drop_last)
        want.append([len(b) for b in DataLoader(Numbers(n), batch_size=batch, sampler=sampler,
                                                drop_last=drop_last)])
    if drop_last and not any(want):
        with pytest.raises(DataError, match="no batch"):
            _rank_batches(n, world, batch, drop_last)
        return
    got = _rank_batches(n, world, batch, drop_last)
    assert [[len(b) for b in rank] for rank in got] == want
    seen = collections.Counter(i for rank in got for b in rank for i in b)
    if drop_last:
        assert max(seen.values()) == 1
    else:  # every sample, and fewer than `world` of them twice (the padding)
        assert set(seen) == set(range(n))
        assert sum(seen.values()) - n == world * -(-n // world) - n


_LAUNCHERS = ("RINGTRAIN_RANK", "RINGTRAIN_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK",
              "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_STEP_ID")


@pytest.mark.parametrize(("env", "given", "warns"), [
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, False, True),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, True, False),
    ({"RANK": "0", "WORLD_SIZE": "1"}, False, False),
    ({}, False, False),
], ids=["launched-not-joined", "rank-given", "one-process", "no-launcher"])
def test_a_launched_job_that_was_not_joined_is_told_every_rank_reads_every_sample(
        monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder,
        env: dict[str, str], given: bool, warns: bool) -> None:
    # Before: `ringrun -np 2 train.py` without rt.init() gave each process the whole
    # dataset in the same order (a world of one), silently: every sample twice an epoch.
    for name in _LAUNCHERS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(loader_module, "_runtime_world", lambda: (0, 1, 1))  # not joined
    shard: dict[str, Any] = {"rank": 0, "world_size": 1} if given else {}
    loader = Loader(Numbers(6), batch_size=2, shuffle=False, num_workers=0, device="cpu", **shard)
    for _ in range(2):  # said once per loader
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
    said = [w for w in recwarn.list if "has not joined the job" in str(w.message)]
    assert len(said) == (1 if warns else 0)
    if warns:
        assert "rank 1 of 2" in str(said[0].message) and said[0].filename == __file__


def _five(shard: int) -> Any:
    return iter(range(10 * shard, 10 * shard + 5))  # every shard has 5 samples


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_stream_shard_longer_than_its_size_is_an_error(shuffle: bool) -> None:
    # Before: sizes [5, 3, 5] (a stale manifest) read samples 10, 11, 12 of shard 1 and
    # never 13, 14, with no error.
    stale = StreamShards([0, 1, 2], _five, sizes=[5, 3, 5])
    with Loader(stale, batch_size=2, shuffle=shuffle, num_workers=0, device="cpu", rank=0,
                world_size=1) as loader:
        with pytest.raises(DataError, match="shard 1 has more samples than its size 3"):
            list(loader)
    right = StreamShards([0, 1, 2], _five, sizes=[5, 5, 5])
    with Loader(right, batch_size=2, shuffle=shuffle, num_workers=0, device="cpu", rank=0,
                world_size=1) as loader:
        assert sorted(int(i) for b in loader for i in b) == [
            10 * s + i for s in range(3) for i in range(5)]


@pytest.mark.timeout(60)
def test_a_stream_shard_longer_than_its_size_is_an_error_in_a_worker() -> None:
    stale = StreamShards([0, 1], _five, sizes=[5, 4])
    with Loader(stale, batch_size=3, shuffle=False, num_workers=2, device="cpu", rank=0,
                world_size=1, timeout=30) as loader:
        with pytest.raises(Exception, match="shard 1 has more samples than its size 4"):
            list(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loop_whose_pass_a_new_iter_ended_is_told_so(num_workers: int) -> None:
    # Before: next(iter(loader)) inside `for b in loader` ended that loop after its third
    # batch with no error (StopIteration): seven of ten batches never trained on.
    with Loader(Numbers(20), batch_size=2, shuffle=False, num_workers=num_workers,
                device="cpu", rank=0, world_size=1, timeout=30) as loader:
        seen = []
        with pytest.raises(DataError, match=r"epoch 0, 3 of 10 batches .* ended by a new "
                                            r"iter\(loader\)"):
            for i, batch in enumerate(loader):
                seen.append(batch.tolist())
                if i == 2:
                    assert next(iter(loader)).tolist() == [0, 1]
        assert seen == [[0, 1], [2, 3], [4, 5]]
        with pytest.raises(DataError, match="ended by a new iter"):
            list(zip(loader, loader, strict=False))


def test_a_loop_whose_pass_load_state_dict_ended_is_told_so() -> None:
    loader = Loader(Numbers(20), batch_size=2, shuffle=False, num_workers=0, device="cpu",
                    rank=0, world_size=1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    next(it)
    loader.load_state_dict(state)
    with pytest.raises(DataError, match=r"2 of 10 batches .* ended by load_state_dict\(\)"):
        next(it)
    assert [b.tolist() for b in loader][0] == [2, 3]  # the restored position


def test_a_pass_broken_off_or_finished_ends_quietly_when_a_new_one_starts() -> None:
    loader = Loader(Numbers(6), batch_size=2, shuffle=False, num_workers=0, device="cpu",
                    rank=0, world_size=1)
    for _ in loader:
        break  # the usual early exit: the next pass starts the epoch again, no error
    finished = iter(loader)
    assert [b.tolist() for b in finished] == [[0, 1], [2, 3], [4, 5]]
    second = iter(loader)
    assert next(second).tolist() == [0, 1]  # epoch 1 (shuffle=False)
    with pytest.raises(StopIteration):
        next(finished)
