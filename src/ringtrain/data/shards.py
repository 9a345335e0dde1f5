"""Sharded datasets: samples that live in shards (files, row groups, URLs).

What the loader needs from a sharded dataset (``rt.data.Loader`` detects
``shard_sizes`` and then splits *shards* across ranks, see
:class:`ringtrain.data.order.ShardPlan`):

* ``shard_sizes``: the number of samples in each shard, in the dataset's order;
* ``__getitems__(indices)``: the samples at dataset indices, where index
  ``shard_start[s] + i`` is sample ``i`` of shard ``s``;
* ``random_access`` (optional, default True): False when a shard can only be read
  front to back, so the loader keeps each shard's samples in order.

:class:`Shards` is the base of ringtrain's readers (``TarShards``, ``ParquetDataset``,
``RecordShards``): it maps dataset indices to shards and calls ``read_shard`` once per
shard a batch touches. :class:`StreamShards` adapts any per-shard iterator, which is
what an ``IterableDataset`` usually is underneath. Readers are map-style too
(``__len__``, ``__getitem__``), so they also work with ``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ringtrain.errors import DataError

__all__ = ["Shards", "StreamShards"]


class Shards:
    """Samples addressed by (shard, number within the shard); subclasses read them.

    Args:
        names: one name per shard (a path or URL), used in error messages.
        sizes: samples per shard.
        transform: applied to every sample read (e.g. decode an image); it runs in the
            loader workers.
    """

    random_access = True

    def __init__(self, names: Sequence[str], sizes: Sequence[int],
                 transform: Callable[[Any], Any] | None = None) -> None:
        if len(names) != len(sizes):
            raise DataError(f"{len(names)} shards but {len(sizes)} sizes; give one size per shard")
        if not names:
            raise DataError("no shards given; pass at least one")
        bad = [(n, s) for n, s in zip(names, sizes, strict=False) if int(s) < 0]
        if bad:
            raise DataError(f"shard {bad[0][0]} has a negative size {bad[0][1]}")
        self.shard_names = [str(n) for n in names]
        self.shard_sizes = tuple(int(s) for s in sizes)
        self.transform = transform
        self._starts = np.concatenate([[0], np.cumsum(self.shard_sizes, dtype=np.int64)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, number within the shard) of dataset index ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} outside [0, {len(self)})")
        s = int(np.searchsorted(self._starts, index, side="right")) - 1
        return s, index - int(self._starts[s])

    def describe(self, index: int) -> str:
        s, i = self.locate(index)
        return f"sample {i} of shard {self.shard_names[s]}"

    def read_shard(self, shard: int, offsets: list[int]) -> list[Any]:
        """The samples at ``offsets`` of shard ``shard`` (before ``transform``)."""
        raise NotImplementedError

    def shard_source(self, shard: int) -> str:
        """The file or URL shard ``shard`` is read from (a row group's file for Parquet)."""
        return self.shard_names[shard]

    def prefetch(self, shards: Sequence[int]) -> None:
        """Start downloading these shards (the loader names the ones a rank reads next)
        where this dataset reads through a :class:`ShardCache`; a no-op otherwise."""
        cache = getattr(self, "cache", None)
        if cache is not None and hasattr(cache, "prefetch"):
            cache.prefetch([self.shard_source(s) for s in shards])

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices outside [0, {len(self)})")
        sid = np.searchsorted(self._starts, idx, side="right") - 1
        out: list[Any] = [None] * len(idx)
        tf = self.transform
        # Shards in the order the batch first touches them (a batch spans one or two).
        _, first = np.unique(sid, return_index=True)
        for s in sid[np.sort(first)].tolist():
            sel = np.flatnonzero(sid == s)
            offsets = (idx[sel] - self._starts[s]).tolist()
            try:
                samples = self.read_shard(s, offsets)
            except Exception as err:
                if hasattr(err, "add_note"):
                    err.add_note(f"(while reading shard {self.shard_names[s]})")
                raise
            for k, sample in zip(sel.tolist(), samples, strict=False):
                out[k] = sample if tf is None else tf(sample)
        return out


class StreamShards(Shards):
    """Shards that can only be read front to back: ``iterate(shard)`` yields its samples.

    This is the form of most ``IterableDataset``\\ s (a list of files, each read in
    order); naming the shards lets the loader split them across ranks and workers,
    give every rank the same number of batches and resume by sample count. The
    samples of a shard keep their order (``shuffle`` permutes the shards).

    Args:
        shards: the shards, as ``iterate`` takes them (paths, URLs, ...).
        iterate: ``iterate(shard) -> iterator of samples``; keep it cheap (raw
            records) and decode in ``transform``: a worker skips the samples of a
            shard that other workers load by iterating past them.
        sizes: samples per shard; counted once by iterating every shard when omitted.
        transform: applied to each sample the loader keeps.
    """

    random_access = False

    def __init__(self, shards: Sequence[Any], iterate: Callable[[Any], Iterable[Any]],
                 sizes: Sequence[int] | None = None,
                 transform: Callable[[Any], Any] | None = None) -> None:
        self.shards = list(shards)
        self.iterate = iterate
        if sizes is None:
            sizes = [sum(1 for _ in iterate(s)) for s in self.shards]
        super().__init__([str(s) for s in self.shards], sizes, transform)
        self._cursors: OrderedDict[int, tuple[Iterator[Any], int]] = OrderedDict()

    def read_shard(self, shard: int, offsets: list[int]) -> list[Any]:
        out = []
        for o in offsets:
            it, pos = self._cursors.pop(shard, (None, 0))
            if it is None or o < pos:  # a new shard, or behind us: start it again
                it, pos = iter(self.iterate(self.shards[shard])), 0
            sample = next(itertools.islice(it, o - pos, None), _END)
            if sample is _END:
                raise DataError(f"shard {self.shard_names[shard]} ended after fewer than "
                                f"{o + 1} samples, but its size is {self.shard_sizes[shard]}")
            if o + 1 == self.shard_sizes[shard] and next(it, _END) is not _END:
                # A size too small (a stale manifest) lost the shard's later samples
                # without a word; reading one more at its end costs at most one record.
                raise DataError(f"shard {self.shard_names[shard]} has more samples than its "
                                f"size {self.shard_sizes[shard]}; pass the right sizes, or "
                                "leave sizes out to count them")
            self._cursors[shard] = (it, o + 1)
            out.append(sample)
        while len(self._cursors) > 2:  # a batch spans at most two shards
            self._cursors.popitem(last=False)
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cursors"] = OrderedDict()  # open iterators stay with their process
        return state


_END = object()
