"""rt.data.Loader with real worker processes: correctness of what arrives."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain.data import Loader, get_worker_info


class Indexed:
    """Sample i is (x[i], i), so every batch says which samples it holds."""

    def __init__(self, n: int, dim: int = 8) -> None:
        self.x = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], i


class Augmented(Indexed):
    """Uses the global RNGs like a typical augmentation pipeline."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i] + np.random.rand() + torch.rand(1).item(), i


class Mixed:
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"img": torch.full((2, 3), float(i)), "meta": (f"id{i}", i * 0.5),
                "worker": get_worker_info().id if get_worker_info() else -1}


class Batched(Indexed):
    def __getitems__(self, indices: list[int]) -> list[tuple[np.ndarray, int]]:
        return [(self.x[i], -1 - i) for i in indices]


def _loader(ds: Any, **kw: Any) -> Loader:
    kw.setdefault("batch_size", 32)
    kw.setdefault("num_workers", 2)
    kw.setdefault("device", "cpu")
    return Loader(ds, **kw)


def _take(loader: Loader, limit: int | None = None) -> list[Any]:
    it = iter(loader)
    out = []
    while limit is None or len(out) < limit:
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


@pytest.mark.timeout(60)
def test_workers_deliver_what_in_process_loading_does() -> None:
    ds = Indexed(5000)
    with _loader(ds, num_workers=0) as here, _loader(ds) as there:
        for _ in range(2):  # two epochs: persistent workers, reused slots
            a, b = _take(here), _take(there)
            assert len(a) == len(b) == len(here)
            for (xa, ia), (xb, ib) in zip(a, b, strict=True):
                assert torch.equal(ia, ib) and torch.equal(xa, xb)
                assert torch.equal(xb, torch.from_numpy(ds.x[ib.numpy()]))
            del a, b
        assert there.fallback_batches <= 2  # only the batches that sized the slots


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zero_copy,dim", [(True, 64), (False, 64), (True, 8192)])
def test_batches_kept_by_the_loop_are_never_overwritten(zero_copy: bool, dim: int) -> None:
    # dim 8192 (32 KiB samples) takes the streaming collate path
    ds = Indexed(6000 if dim == 64 else 1500, dim=dim)
    with _loader(ds, batch_size=50, keep=3, zero_copy=zero_copy) as loader:
        for _ in range(2):
            kept = _take(loader)  # hold every batch of the epoch
            for x, i in kept:
                assert torch.equal(x, torch.from_numpy(ds.x[i.numpy()]))
            assert sorted(torch.cat([i for _, i in kept]).tolist()) == list(range(len(ds)))
            assert loader.copied_batches > 0  # beyond `keep`, batches were copied out
            del kept
        # a loop that holds one batch at a time gets zero-copy batches again
        before = loader.copied_batches
        for x, i in loader:
            assert torch.equal(x, torch.from_numpy(ds.x[i.numpy()]))
        assert (loader.copied_batches == before) == zero_copy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_disjoint_covering_shards_of_equal_length(drop_last: bool) -> None:
    ds, world = Indexed(1001), 3
    per_rank = []
    for r in range(world):
        with _loader(ds, num_workers=1, rank=r, world_size=world, drop_last=drop_last,
                     seed=11) as loader:
            per_rank.append([i for _, i in _take(loader)])
    assert len({len(batches) for batches in per_rank}) == 1
    flat = torch.cat([torch.cat(b) for b in per_rank]).tolist()
    if drop_last:
        assert len(set(flat)) == len(flat) > 1001 - world * 32
    else:
        assert set(flat) == set(range(1001)) and len(flat) - 1001 < world


@pytest.mark.timeout(60)
def test_resume_mid_epoch_and_across_epochs_with_workers() -> None:
    ds = Indexed(3000)
    with _loader(ds) as ref:
        expected = [i.tolist() for _, i in _take(ref) + _take(ref)]
    with _loader(ds) as run:
        got = [i.tolist() for _, i in _take(run, limit=40)]
        state = run.state_dict()
    with _loader(ds) as resumed:
        resumed.load_state_dict(state)
        got += [i.tolist() for _, i in _take(resumed)]  # rest of epoch 0 ...
        assert resumed.epoch == 1
        got += [i.tolist() for _, i in _take(resumed)]  # ... and all of epoch 1
    assert got == expected


@pytest.mark.timeout(60)
def test_a_resumed_loader_augments_as_the_uninterrupted_one() -> None:
    # The resumed loader loads its first batch in halves on two workers; the
    # uninterrupted one loaded that batch whole on one worker.
    ds = Augmented(2000)
    with _loader(ds) as ref:
        expected = _take(ref)
    with _loader(ds) as run:
        got = _take(run, limit=25)
        state = run.state_dict()
    with _loader(ds) as resumed:
        resumed.load_state_dict(state)
        got += _take(resumed)
    assert len(got) == len(expected)
    for (xa, ia), (xb, ib) in zip(got, expected, strict=True):
        assert torch.equal(ia, ib) and torch.equal(xa, xb)


@pytest.mark.timeout(60)
def test_augmentation_rng_does_not_depend_on_the_worker() -> None:
    ds = Augmented(2000)
    with _loader(ds, num_workers=1) as one, _loader(ds, num_workers=2) as two:
        for (xa, ia), (xb, ib) in zip(_take(one), _take(two), strict=True):
            assert torch.equal(ia, ib) and torch.equal(xa, xb)


@pytest.mark.timeout(60)
def test_variable_shapes_grow_the_slots() -> None:
    class Ragged:
        def __len__(self) -> int:
            return 400

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((i + 1,), float(i))

    def pad(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(len(s) for s in samples)
        out = torch.zeros(len(samples), n)
        for row, s in zip(out, samples, strict=True):
            row[: len(s)] = s
        return out, torch.tensor([len(s) for s in samples])

    with _loader(Ragged(), batch_size=16, collate_fn=pad, shuffle=False) as loader:
        for _ in range(2):
            batches = _take(loader)
            for k, (x, lengths) in enumerate(batches):
                assert x.shape == (16, 16 * k + 16)  # every batch longer than the last
                assert lengths.tolist() == list(range(16 * k + 1, 16 * k + 17))
                assert torch.equal(x[:, 0], lengths.float() - 1)
        assert loader.fallback_batches >= 2  # some did not fit and made the slots grow
        assert loader.fallback_batches < 25  # ... geometrically, not batch after batch


@pytest.mark.timeout(60)
def test_dict_tuple_and_string_samples() -> None:
    with _loader(Mixed(), batch_size=8, shuffle=False) as loader:
        batches = _take(loader)
    first = batches[0]
    assert first["img"].shape == (8, 2, 3) and first["img"][3, 0, 0] == 3
    names, halves = first["meta"]  # a list of fields, the strings a tuple, as DataLoader's
    assert type(first["meta"]) is list
    assert names == tuple(f"id{i}" for i in range(8)) and halves.dtype == torch.float64
    assert set(torch.cat([b["worker"] for b in batches]).tolist()) <= {0, 1}


@pytest.mark.timeout(60)
def test_a_fresh_loader_loads_its_first_batch_in_halves_on_two_workers() -> None:
    # The batch the loop waits for first is cut between both idle workers; the next one
    # goes whole to one worker, as every later batch does.
    with _loader(Mixed(), batch_size=8, shuffle=False, num_workers=2) as loader:
        first, second = _take(loader, limit=2)
    assert first["worker"].tolist() == [0] * 4 + [1] * 4
    assert first["img"][:, 0, 0].tolist() == list(range(8)) and first["meta"][0][7] == "id7"
    assert len(second["worker"].unique()) == 1


class WhoBatched(Mixed):
    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [self[i] for i in indices]


@pytest.mark.timeout(60)
def test_getitems_datasets_and_collate_fns_keep_whole_first_batches() -> None:
    # One __getitems__ call per batch, and a collate_fn's output cannot be joined.
    with _loader(WhoBatched(), batch_size=8, shuffle=False) as loader:
        assert len(_take(loader, limit=1)[0]["worker"].unique()) == 1
    with _loader(Mixed(), batch_size=8, shuffle=False,
                 collate_fn=lambda s: torch.tensor([x["worker"] for x in s])) as loader:
        assert len(_take(loader, limit=1)[0].unique()) == 1


@pytest.mark.timeout(60)
def test_getitems_runs_in_the_workers() -> None:
    with _loader(Batched(500), batch_size=50) as loader:
        labels = torch.cat([i for _, i in _take(loader)])
    assert sorted((-1 - labels).tolist()) == list(range(500))


@pytest.mark.timeout(60)
def test_spawn_start_method() -> None:
    ds = Indexed(300)
    with _loader(ds, start_method="spawn", batch_size=64) as loader:
        got = torch.cat([i for _, i in _take(loader)])
    assert sorted(got.tolist()) == list(range(300))


@pytest.mark.timeout(60)
def test_auto_workers_adapt_to_a_slow_dataset(caplog: pytest.LogCaptureFixture) -> None:
    class Slow(Indexed):  # I/O-like: sleeps, so more workers than cores help
        def __getitems__(self, indices: list[int]) -> list[tuple[np.ndarray, int]]:
            time.sleep(0.01)
            return [(self.x[i], i) for i in indices]

    with caplog.at_level(logging.INFO, logger="ringtrain.data"):
        with _loader(Slow(8000), batch_size=4, num_workers="auto", max_workers=6) as loader:
            start = loader.num_workers
            deadline = time.monotonic() + 20
            while loader.num_workers <= start and time.monotonic() < deadline:
                for _ in loader:
                    if loader.num_workers > start:
                        break
    assert loader.num_workers > start
    assert any("num_workers=auto -> " in r.getMessage() and "waited" in r.getMessage()
               for r in caplog.records)


class SlowBatches(Indexed):
    """Every batch takes a worker at least 20 ms (as a slow disk would)."""

    def __getitems__(self, indices: list[int]) -> list[tuple[np.ndarray, int]]:
        time.sleep(0.02)
        return [(self.x[i], i) for i in indices]


@pytest.mark.timeout(60)
def test_wait_hooks_show_an_input_bound_loop_and_a_compute_bound_one() -> None:
    # Input-bound: one worker needs >= 20 ms per batch and the loop does nothing, so
    # the loop spends nearly all its time waiting in next(). Load on the machine only
    # lengthens the waits.
    with _loader(SlowBatches(640), num_workers=1, batch_size=32) as loader:
        t0 = time.perf_counter()
        longest = max(loader.last_wait_s for _ in loader)
        wall = time.perf_counter() - t0
        assert loader.total_wait_s > 0.5 * wall and longest > 0.01
        assert loader.stats()["total_wait_s"] == loader.total_wait_s
    # Compute-bound: the loop "computes" 30 ms per batch, far longer than two workers
    # need for a batch of tiny samples, so after the first batch (which waits for the
    # workers to start) it hardly ever waits.
    with _loader(Indexed(2000), batch_size=100) as loader:
        steps, first = 0.0, None
        for _ in loader:
            first = loader.last_wait_s if first is None else first
            t = time.perf_counter()
            time.sleep(0.03)
            steps += time.perf_counter() - t
        assert first is not None and loader.total_wait_s - first < 0.5 * steps


@pytest.mark.timeout(60)
def test_breaking_out_of_epochs_leaks_no_slots() -> None:
    ds = Indexed(4000)
    with _loader(ds, batch_size=40, prefetch=8, keep=4) as loader:
        for _ in range(15):  # abandon with batches in flight, again and again
            for k, _ in enumerate(loader):
                if k == 3:
                    break
        loader.set_epoch(7)
        batches = _take(loader)
        assert sorted(torch.cat([i for _, i in batches]).tolist()) == list(range(4000))
        for x, i in batches:
            assert torch.equal(x, torch.from_numpy(ds.x[i.numpy()]))
        # documented bound: prefetch + keep + 1 slots
        assert 0 < loader.stats()["slots"] <= 8 + 4 + 1


class Logged(Indexed):
    """Appends every sample index it loads to a file (from any process)."""

    def __init__(self, n: int, log: Any) -> None:
        super().__init__(n)
        self.log = log

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return super().__getitem__(i)

    def loaded(self) -> list[int]:
        with open(self.log) as f:
            return [int(line) for line in f]


@pytest.mark.timeout(60)
def test_next_epoch_loads_while_this_one_ends(tmp_path: Any) -> None:
    ds = Logged(3000, tmp_path / "loaded.txt")
    with _loader(ds, batch_size=100, prefetch=4) as loader, \
            _loader(Indexed(3000), batch_size=100, num_workers=0) as ref:
        ref.set_epoch(1)
        next_first = set(torch.cat([i for _, i in _take(ref, limit=4)]).tolist())
        for epoch in range(3):
            loader.set_epoch(epoch)
            ref.set_epoch(epoch)
            got = [i.tolist() for _, i in _take(loader)]
            assert got == [i.tolist() for _, i in _take(ref)]
            if epoch == 0:
                # Epoch 1 was under way before the loop asked for it: the workers load
                # its first batches (and only those) with no iter() called yet.
                deadline = time.monotonic() + 20
                while len(ds.loaded()) <= 3000 and time.monotonic() < deadline:
                    time.sleep(0.01)
                counts = np.bincount(ds.loaded(), minlength=3000)
                ahead = set(np.flatnonzero(counts > 1).tolist())
                assert ahead and ahead <= next_first and counts.max() == 2
        # leave epoch 3 early, then go on with epoch 4 (the prefetched one) ...
        loader.set_epoch(3)
        assert len(_take(loader, limit=5)) == 5
        loader.set_epoch(4)
        ref.set_epoch(4)
        assert [i.tolist() for _, i in _take(loader)] == [i.tolist() for _, i in _take(ref)]
        # ... and with one it did not expect
        loader.set_epoch(9)
        ref.set_epoch(9)
        assert [i.tolist() for _, i in _take(loader)] == [i.tolist() for _, i in _take(ref)]
        stats = loader.stats()
        assert 0 < stats["slots"] <= 4 + 4 + 1  # prefetch + keep + 1
        assert stats["held_batches"] == 0  # _take dropped every batch


def _helper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ringtrain-loader-helper"]


@pytest.mark.timeout(60)
def test_helper_thread_wraps_batches_during_the_step() -> None:
    # A loop that "computes" (sleeps, as a device step leaves the CPU free) finds most
    # batches already wrapped by the helper; what it gets is still exactly the data.
    ds = Indexed(1200)
    with _loader(ds, batch_size=50) as loader:
        seen = []
        for x, i in loader:
            time.sleep(0.03)
            assert torch.equal(x, torch.from_numpy(ds.x[i.numpy()]))
            seen += i.tolist()
        assert sorted(seen) == list(range(len(ds)))
        # Typically nearly all of them; on a loaded machine the workers may answer
        # late, but in 24 steps of 30 ms the helper always wrapped some.
        assert loader.ahead_batches >= 1
        assert loader.stats()["ahead_batches"] == loader.ahead_batches
        assert len(_helper_threads()) == 1
    assert not _helper_threads()  # close() stops it


@pytest.mark.timeout(60)
def test_helper_thread_rests_in_a_loop_without_steps() -> None:
    # No time between batches: nothing to hide work behind, so the helper parks and
    # the loop takes each batch itself (still exactly the data).
    ds = Indexed(4000)
    with _loader(ds, batch_size=50) as loader:
        for epoch in range(2):
            before = loader.ahead_batches
            loader.set_epoch(epoch)
            for x, i in loader:
                assert torch.equal(x, torch.from_numpy(ds.x[i.numpy()]))
            # a few before it noticed, of 80 (typically <= 2; a loaded machine that
            # descheduled the loop for over 1 ms makes it look like a step, now and then)
            assert loader.ahead_batches - before <= len(loader) // 2
        assert loader.batches_yielded == 2 * len(loader)


class DiesAt(Indexed):
    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at = at

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == self.at and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


@pytest.mark.timeout(60)
def test_a_worker_death_seen_by_the_helper_is_raised_by_the_loop() -> None:
    from ringtrain.errors import WorkerDiedError

    with _loader(DiesAt(2000, at=1500), batch_size=50, shuffle=False) as loader:
        got = 0
        with pytest.raises(WorkerDiedError, match="killed by SIGKILL"):
            for _ in loader:
                time.sleep(0.02)  # the helper, not the loop, is the one to see it first
                got += 1
        assert got < 1500 // 50
        assert not _helper_threads()
        # a new iteration starts fresh workers and a fresh helper, and goes on from
        # the batch that was lost
        loader.dataset.at = -1
        rest = _take(loader)
        assert got + len(rest) == len(loader)
        assert rest[0][1][0].item() == 50 * got
