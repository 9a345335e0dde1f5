"""Small pieces the data tests share: a list as a map-style dataset, a half batch
collated and packed as a loader worker makes it, and a tar shard of numbered members."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from ringtrain.data.collate import Arena, StreamCollator, default_collate, pack

__all__ = ["Items", "packed_half", "tar_of"]


class Items:
    """``items`` as a map-style dataset (``__len__`` and ``__getitem__`` only)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def packed_half(samples: list[Any], stream: bool = False) -> tuple[tuple, np.ndarray]:
    """``samples`` collated as a worker collates half a batch (numbers stay raw) and
    packed: the spec and its buffer, for ``join_halves``."""
    arena = Arena(np.zeros(1 << 20, dtype=np.uint8))
    if stream:
        collator = StreamCollator(samples[0], len(samples), arena.alloc, raw_numbers=True)
        for i, s in enumerate(samples):
            collator.put(i, s)
        return pack(collator.result(), arena), arena.buf
    return pack(default_collate(samples, arena.alloc, raw_numbers=True), arena), arena.buf


def tar_of(path: Path, members: list[str], fmt: int = tarfile.DEFAULT_FORMAT) -> Path:
    """A tar file at ``path`` whose member ``i`` is named ``members[i]`` and holds ``str(i)``."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for i, name in enumerate(members):
            data = str(i).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path
