"""Passes over a loader with workers: after close() (or its with-block), and passes
that take every batch without asking for one more."""

from __future__ import annotations

import gc
import itertools
import os
import time

import pytest
import torch

from ringtrain.data import Loader


class Numbers:
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first_pass", ["whole epoch", "break"])
def test_iterating_after_close_starts_fresh_workers_that_end_with_the_loader(
        first_pass: str) -> None:
    # Before: the second pass raised "the loader cannot schedule batch 0 ... this is a
    # bug" (close() kept the next epoch's batches dispatched to the stopped workers, and
    # the pass adopted them); and the workers it started had no finalizer left, so they
    # outlived the loader.
    loader = Loader(Numbers(), batch_size=4, shuffle=False, num_workers=2, device="cpu")
    with loader:
        for k, _ in enumerate(loader):
            if first_pass == "break" and k == 1:
                break
    assert loader.worker_pids == []
    loader.set_epoch(1)
    batches = [b.tolist() for b in loader]
    assert batches == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    pids = loader.worker_pids
    assert len(pids) == 2
    del loader, batches
    gc.collect()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), f"workers {pids} outlived the loader (pid {os.getpid()})"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_pass_that_takes_every_batch_ends_the_epoch_without_asking_for_more(
        num_workers: int) -> None:
    # Before: a pass that never asked past the last batch (islice/zip over len(loader),
    # or next(it) len(loader) times) left the epoch open, so every such pass ran epoch 0
    # in the same order again, while state_dict() already said epoch 1.
    def passes(take_all: bool) -> tuple[list[list[int]], list[dict]]:
        loader = Loader(Numbers(), batch_size=4, shuffle=True, seed=3,
                        num_workers=num_workers, device="cpu")
        out, states = [], []
        for _ in range(3):
            batches = loader if take_all else itertools.islice(loader, len(loader))
            out.append([x for b in batches for x in b.tolist()])
            states.append(loader.state_dict())
        loader.close()
        return out, states

    exact, exact_states = passes(take_all=True)
    assert passes(take_all=False) == (exact, exact_states)
    assert len({tuple(p) for p in exact}) == 3  # three epochs, three orders
    assert [s["epoch"] for s in exact_states] == [1, 2, 3]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_during_a_pass_is_the_next_passs_epoch(num_workers: int) -> None:
    # Before: the pass's next batch raised a bare AssertionError (set_epoch dropped the
    # plan the pass was reading).
    def make() -> Loader:
        return Loader(Numbers(), batch_size=4, shuffle=True, seed=1,
                      num_workers=num_workers, device="cpu")

    with make() as ref:
        ref.set_epoch(0)
        epoch0 = [b.tolist() for b in ref]
        ref.set_epoch(5)
        epoch5 = [b.tolist() for b in ref]
    with make() as loader:
        it = iter(loader)
        got = [next(it).tolist()]
        loader.set_epoch(5)
        got += [b.tolist() for b in it]
        assert got == epoch0  # the pass went on in its own order
        assert loader.state_dict()["epoch"] == 5
        assert [b.tolist() for b in loader] == epoch5
        it = iter(loader)  # epoch 6, broken off after one batch
        next(it)
        loader.set_epoch(8)
        state = loader.state_dict()  # where the loop stands: after that batch
        assert (state["epoch"], state["position"]) == (6, 4)
        with make() as ref8:
            ref8.set_epoch(8)
            assert [b.tolist() for b in loader] == [b.tolist() for b in ref8]


class Growing:
    """A list-backed dataset whose list the training process replaces between passes."""

    def __init__(self, n: int) -> None:
        self.items = list(range(n))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(self.items[i])


@pytest.mark.timeout(60)
def test_a_dataset_that_changed_length_gets_fresh_workers() -> None:
    # Before: the workers kept the dataset as it was when they were forked: after it grew
    # they raised IndexError for the new indices, after it shrank they read the old
    # samples (num_workers=0 read the new ones).
    ds = Growing(20)
    with Loader(ds, batch_size=4, shuffle=False, num_workers=2, device="cpu") as loader:
        assert sorted(x for b in loader for x in b.tolist()) == list(range(20))
        ds.items = list(range(100, 130))
        assert sorted(x for b in loader for x in b.tolist()) == list(range(100, 130))
        ds.items = list(range(200, 212))
        assert sorted(x for b in loader for x in b.tolist()) == list(range(200, 212))
        ds.items = list(range(300, 312))  # the same length: close() hands it over (docs)
        loader.close()
        assert sorted(x for b in loader for x in b.tolist()) == list(range(300, 312))
