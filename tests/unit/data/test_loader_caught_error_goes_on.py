"""A loop that catches a batch's error and calls ``next()`` on the same iterator again
gets the batches after the failed one, as DataLoader's iterator gives them (the epoch
used to end there with StopIteration: its other batches never trained on, silently).
A failed last batch ends the epoch, and the next pass is the next epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import DataLoader

import ringtrain as rt


class _Flaky:
    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise ValueError(f"sample {i} is damaged")
        return i


def _drain(it: Iterator[Any]) -> tuple[int, list[int]]:
    errors, got = 0, []
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return errors, got
        except ValueError:
            errors += 1
            continue
        got += [int(x) for x in batch]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bad", [{13}, {47}, {0, 20, 21, 40}])
def test_a_caught_error_skips_the_failed_batch_as_dataloader(workers: int, bad: set[int]) -> None:
    want = _drain(iter(DataLoader(_Flaky(bad), batch_size=8, num_workers=workers)))
    loader = rt.data.Loader(_Flaky(bad), batch_size=8, shuffle=False, num_workers=workers,
                            rank=0, world_size=1)
    try:
        assert _drain(iter(loader)) == want
        assert loader.epoch == 1  # the pass ended; the next is the next epoch
        assert _drain(iter(loader)) == want
    finally:
        loader.close()
