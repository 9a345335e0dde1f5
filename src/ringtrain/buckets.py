"""Plan fusion buckets: which gradients travel together in one flat buffer.

Pure function of the parameters' order, sizes and dtypes, so every rank computes the
same plan without talking. Gradients become ready roughly in reverse order of
registration (backward runs from the loss to the input), so buckets are filled from
the last parameter backwards; the first bucket is then ready earliest and its
exchange overlaps the rest of backward (the order PyTorch DDP uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringtrain.errors import ConfigError

__all__ = ["BucketSpec", "plan_buckets"]


@dataclass(frozen=True)
class BucketSpec:
    """One fused buffer: the indices of its parameters (in pack order) and their offsets."""

    index: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device


def plan_buckets(
    shapes: Sequence[torch.Size],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    bucket_bytes: int,
) -> list[BucketSpec]:
    """Group parameters (given in registration order) into buckets of at most
    ``bucket_bytes`` each (a single larger tensor gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    if not len(shapes) == len(dtypes) == len(devices):
        raise ValueError("shapes, dtypes and devices must have the same length")
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[list[int]] = []
    for i in reversed(range(len(shapes))):
        key = (dtypes[i], devices[i])
        size = int(torch.Size(shapes[i]).numel()) * torch.empty((), dtype=dtypes[i]).element_size()
        current = open_buckets.setdefault(key, [])
        if current and open_bytes[key] + size > bucket_bytes:
            closed.append(current)
            current = open_buckets[key] = []
            open_bytes[key] = 0
        current.append(i)
        open_bytes[key] = open_bytes.get(key, 0) + size
    closed.extend(b for b in open_buckets.values() if b)
    # Order buckets by when they fill: the one holding the latest-registered parameter
    # (ready first in backward) comes first.
    closed.sort(key=lambda b: -b[0])
    specs = []
    for index, members in enumerate(closed):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += int(torch.Size(shapes[i]).numel())
        specs.append(
            BucketSpec(index, tuple(members), tuple(offsets), total, dtypes[members[0]], devices[members[0]])
        )
    return specs
