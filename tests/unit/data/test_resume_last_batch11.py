"""A checkpoint taken inside the loop at an epoch's last batch, resumed by a loop that
does not call ``set_epoch`` (the loader advances its epoch by itself): the resumed loop
comes back into the epoch it was in, so the loader's next pass must be that epoch's
empty rest, as StatefulDataLoader's is. Before, the restored loader went straight to the
next epoch's data: the resumed run trained one epoch more than the run that was not
stopped, each later epoch shifted by one. A state saved after the pass ended (its loop
was told so, or let it go) still resumes into the next epoch at once."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ringtrain.data import Loader

EPOCHS, SAVE_IN = 3, 1  # the checkpoint: at the last batch of the loop's epoch 1


class Numbers:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i


def _loader(num_workers: int) -> Loader:
    return Loader(Numbers(), batch_size=3, shuffle=True, seed=7, num_workers=num_workers,
                  device="cpu", rank=0, world_size=1, timeout=30)


def _for(loader: Loader) -> Iterator[Any]:
    yield from loader


def _islice(loader: Loader) -> Iterator[Any]:
    yield from itertools.islice(loader, len(loader))  # never asks past the last batch


def _train(loader: Loader, passes: Callable[[Loader], Iterator[Any]], first: int,
           save_at: tuple[int, int] | None) -> tuple[list[tuple[int, list[int]]], Any]:
    """(the loop's epoch, batch) of every batch from epoch ``first`` on, and the state
    saved at (epoch, batch) ``save_at`` ("after" as the batch: once the pass is over)."""
    seen, state = [], None
    for epoch in range(first, EPOCHS):
        for i, batch in enumerate(passes(loader)):
            seen.append((epoch, batch.tolist()))
            if save_at == (epoch, i):
                state = loader.state_dict()
        if save_at == (epoch, "after"):
            state = loader.state_dict()
    return seen, state


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_checkpoint_at_an_epochs_last_batch_resumes_without_an_extra_epoch(num_workers: int) -> None:
    with _loader(num_workers) as straight, _loader(num_workers) as resumed:
        last = len(straight) - 1
        for passes, save_at, first in ((_for, (SAVE_IN, last), SAVE_IN),
                                       (_islice, (SAVE_IN, last), SAVE_IN),
                                       (_for, (SAVE_IN, "after"), SAVE_IN + 1),
                                       (_islice, (SAVE_IN, "after"), SAVE_IN + 1)):
            straight.load_state_dict(_loader(0).state_dict())  # epoch 0 again
            seen, state = _train(straight, passes, 0, save_at)
            assert [e for e, _ in seen] == [e for e in range(EPOCHS) for _ in range(last + 1)]
            resumed.load_state_dict(state)
            assert resumed.state_dict() == state  # as saved, before any pass
            again, _ = _train(resumed, passes, first, None)
            assert again == [s for s in seen if s[0] > SAVE_IN], (passes.__name__, save_at)


def test_set_epoch_after_such_a_resume_picks_either_epoch() -> None:
    loader = _loader(0)
    for i, _ in enumerate(loader):
        if i == len(loader) - 1:
            state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 0 and state["finished_epoch"] == 0
    nxt = [b.tolist() for b in loader]  # epoch 1, as the loop went on
    for epoch, expect in ((0, []), (1, nxt)):
        again = _loader(0)
        again.load_state_dict(state)
        again.set_epoch(epoch)
        assert [b.tolist() for b in again] == expect
