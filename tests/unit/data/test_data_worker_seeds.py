"""Random numbers in loader workers with seed_workers=False: each worker its own."""

from __future__ import annotations

import pytest
import torch

from ringtrain.data import Loader


class TorchAug:
    """Draws from torch's global generator, as torchvision's random transforms do."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [2, 3])
def test_workers_without_per_batch_seeds_draw_different_numbers(num_workers: int) -> None:
    # Before: forked workers kept the training process's torch generator state, so with
    # seed_workers=False they drew the same numbers: values repeated from worker to
    # worker (6 of 32 with 3 workers), the two halves of the first batch alike.
    with Loader(TorchAug(), batch_size=4, shuffle=False, num_workers=num_workers,
                device="cpu", seed_workers=False) as loader:
        values = torch.cat([b.flatten() for b in loader]).tolist()
    assert len(set(values)) == len(values) == 48
