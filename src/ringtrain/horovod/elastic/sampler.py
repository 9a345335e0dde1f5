"""``hvd.elastic.ElasticSampler``: a distributed sampler that remembers what was processed.

Each epoch's order is a pure function of (seed, epoch). The sampler records the indices
of the batches the loop finished (``record_batch``); after a restart or a change of
world size, the samples not yet processed this epoch are split again over the current
ranks, so no sample of the epoch is skipped and none is repeated (up to the padding
that gives every rank the same number of samples, as ``DistributedSampler``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self._padded: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: nothing of it processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """The loop finished batch ``batch_idx`` (of ``batch_size`` samples).

        Data-parallel ranks step together, so every rank's batch ``batch_idx`` is done:
        all of them are recorded (each rank can compute the others' from the split).
        Every rank's sampler then holds the whole job's progress, and the one rank 0
        persists is enough to resume after a restart."""
        lo, hi = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for r in range(self.num_replicas):
            self.record_indices(self._padded[r::self.num_replicas][lo:hi])

    def record_indices(self, indices: list[int]) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def reset(self) -> None:
        """Split what is left of the epoch over the current ranks."""
        from ringtrain import runtime

        if runtime.is_initialized():
            self.num_replicas, self.rank = runtime.size(), runtime.rank()
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        per_rank = math.ceil(len(self.remaining_indices) / self.num_replicas) if self.remaining_indices else 0
        padded = list(self.remaining_indices)
        while len(padded) < per_rank * self.num_replicas:
            padded += self.remaining_indices[: per_rank * self.num_replicas - len(padded)]
        self._padded = padded
        self.indices = padded[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
