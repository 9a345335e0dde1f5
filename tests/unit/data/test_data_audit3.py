"""Loader audit: workers seeded as DataLoader seeds them, and errors that number a
resumed epoch's batches by their place in the epoch."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from ringtrain.data import Loader, get_worker_info
from ringtrain.errors import DataError, WorkerError

N, BATCH = 24, 4


class TorchAug:
    """Each sample: a torch.rand augmentation, the worker's id and torch.initial_seed()."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        info = get_worker_info()
        assert info is not None
        return torch.rand(()), info.id, torch.initial_seed()


def _pass(manual_seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(augmentations, worker ids, worker seeds), each [batches, BATCH]."""
    torch.manual_seed(manual_seed)
    with Loader(TorchAug(), batch_size=BATCH, shuffle=False, num_workers=2,
                device="cpu", seed_workers=False) as loader:
        batches = list(loader)
    aug, wid, seed = (torch.stack([b[f] for b in batches]) for f in range(3))
    return aug, wid, seed


@pytest.mark.timeout(60)
def test_workers_without_per_batch_seeds_repeat_under_torch_manual_seed() -> None:
    # Before: each worker was seeded from the OS, so two runs of a script that called
    # torch.manual_seed(0) drew different augmentations.
    first, again = _pass(0)[0], _pass(0)[0]
    assert torch.equal(first, again)
    assert len(set(first.flatten().tolist())) == N  # the workers draw apart
    assert not torch.equal(_pass(1)[0], first)


@pytest.mark.timeout(60)
def test_worker_seeds_are_a_base_from_torchs_generator_plus_the_worker_id() -> None:
    # DataLoader's rule: one base seed drawn from the training process's default
    # generator, worker i seeded with base + i; and batches go to the workers in turn.
    torch.manual_seed(5)
    base = int(torch.empty((), dtype=torch.int64).random_().item())
    after_one_draw = torch.rand(3)
    _, wid, seed = _pass(5)
    assert torch.equal(torch.rand(3), after_one_draw)  # the loader drew exactly once
    assert wid[:, 0].tolist() == [k % 2 for k in range(N // BATCH)]
    assert dict(zip(wid.flatten().tolist(), seed.flatten().tolist(), strict=True)) == {
        0: base, 1: base + 1}


class FailsAt:
    """Sample ``bad`` raises (``hang``: sleeps instead)."""

    def __init__(self, bad: int, hang: bool = False) -> None:
        self.bad, self.hang = bad, hang

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            if self.hang:
                time.sleep(30)
            raise ValueError(f"sample {i} is broken")
        return i


def _resumed(dataset: FailsAt, **kwargs: Any) -> Loader:
    """A loader resumed after two batches of the epoch (position 8)."""
    done = Loader(FailsAt(-1), batch_size=BATCH, shuffle=False, num_workers=0, device="cpu",
                  rank=0, world_size=1)
    it = iter(done)
    next(it), next(it)
    loader = Loader(dataset, batch_size=BATCH, shuffle=False, num_workers=1, device="cpu",
                    rank=0, world_size=1, **kwargs)
    loader.load_state_dict(done.state_dict())
    return loader


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hang", [False, True], ids=["raises", "hangs"])
def test_a_resumed_loaders_error_numbers_the_batch_in_its_epoch(hang: bool) -> None:
    # Before: "batch 1 of epoch 0" for samples 12-15, counted from the resume point;
    # it is the epoch's batch 3 (0-3, 4-7 and 8-11 come before it).
    with _resumed(FailsAt(13, hang), timeout=0.5 if hang else None) as loader:
        with pytest.raises((WorkerError, DataError)) as caught:
            list(loader)
    message = str(caught.value)
    assert "batch 3 of epoch 0" in message and "batch 1 " not in message, message
    assert "12, 13, 14, 15" in message or "sample index 13" in message, message


@pytest.mark.parametrize("sharded", [False, True], ids=["map-style", "sharded"])
def test_a_resumed_plans_batches_are_the_epochs_from_first_batch_on(sharded: bool) -> None:
    from ringtrain.data.order import EpochPlan, ShardPlan

    def plan(start: int, resumed: tuple[tuple[int, int, int], ...] = ()) -> Any:
        if sharded:
            return ShardPlan((7, 9, 5, 11), 3, 2, 1, seed=4, start=start, resumed=resumed)
        return EpochPlan(64, 3, 2, 1, seed=4, start=start)

    whole = plan(0)
    done = 3 * (3 if sharded else 3 * 2)  # three batches on each of the two ranks
    rest = plan(done)
    assert rest.first_batch == 3
    for k in range(rest.num_batches):
        assert rest.indexer()(k).tolist() == whole.indexer()(3 + k).tolist()
    if sharded:  # resumed at another world size: earlier stages' batches count too
        assert plan(6, ((4, 3, 5),)).first_batch == 2 + 2  # ceil(5 / 3) + 6 / 3
