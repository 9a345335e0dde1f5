"""``hvd.elastic.ElasticSampler``: a distributed sampler that remembers what was processed.

Horovod's contract (horovod/torch/elastic/sampler.py since 0.23), which scripts and
checkpoints written for Horovod rely on:

- an epoch's order is ``random.Random(seed + epoch).shuffle(list(range(len(dataset))))``
  (or ``0..n-1`` without shuffling), the same on every rank;
- ``record_batch(batch_idx, batch_size)`` counts ``batch_size * num_replicas`` samples
  of that order as processed (``processed_num``): the ranks step together, and rank
  ``r`` takes every ``num_replicas``-th of what is left, so the samples done so far are
  always the order's first ``processed_num``. ``batch_idx`` is not used: a script may
  pass the batch's index in the epoch (``state.batch``) or since the last reset alike;
- after a reset (``reset()``, called by ``set_epoch``, ``load_state_dict`` and the
  state's ``restore()``/``sync()``), what is left of the epoch is split over the current
  ranks, padded as ``DistributedSampler`` pads so every rank has as many samples;
- ``state_dict()`` is ``{"epoch", "processed_num"}`` (plus ``processed_indices``, below).

``record_indices(indices)`` is the API of Horovod before 0.23, kept for scripts written
for it: each rank records the dataset indices it processed, the state's ``sync()`` takes
the union over the ranks, and those indices are left out of what remains. Use one of the
two ways of recording in a script, not both.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

__all__ = ["ElasticSampler", "epoch_order"]


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order of an epoch's ``n`` samples, as Horovod's ``ElasticSampler`` draws it
    (Python's ``random``, not torch's: the same samples on the same ranks as under
    Horovod, and a Horovod checkpoint's ``processed_num`` means the same samples here)."""
    order = list(range(n))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


class ElasticSampler(torch.utils.data.Sampler[int]):
    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self._order_key: tuple[int, int, int, bool] | None = None
        self._order: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: nothing of it processed yet (call it when an epoch ends, as
        Horovod says, so that a reset mid-epoch does not start the epoch over)."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """One more batch of ``batch_size`` samples done on every rank (``batch_idx`` is
        not used, as in Horovod)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Iterable[int]) -> None:
        """This rank processed the samples ``indices`` (Horovod before 0.23)."""
        self.processed_indices.update(int(i) for i in indices)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_num = int(state.get("processed_num", 0))  # absent in Horovod < 0.23's
        self.processed_indices = {int(i) for i in state.get("processed_indices", ())}
        self.reset()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_num": self.processed_num,
                "processed_indices": sorted(self.processed_indices)}

    def _epoch_order(self) -> list[int]:
        key = (len(self.dataset), self.seed, self.epoch, self.shuffle)
        if key != self._order_key:  # restore()/sync() reset often; shuffling 1M ids takes ~0.5 s
            self._order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
            self._order_key = key
        return self._order

    def reset(self) -> None:
        """Split what is left of the epoch over the current ranks."""
        from ringtrain import runtime

        if runtime.is_initialized():
            self.num_replicas, self.rank = runtime.size(), runtime.rank()
        rest = self._epoch_order()[self.processed_num:]
        if self.processed_indices:
            rest = [i for i in rest if i not in self.processed_indices]
        self.remaining_indices = rest
        self.num_samples = math.ceil(len(rest) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = list(rest)
        while len(padded) < self.total_size:  # fewer left than ranks: repeat as often as needed
            padded += rest[: self.total_size - len(padded)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
