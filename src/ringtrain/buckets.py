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


#: The first bucket is capped lower, as PyTorch DDP does (1 MB), so the exchange starts
#: early in backward instead of waiting for a full 25 MB of gradients.
FIRST_BUCKET_BYTES = 1024 * 1024


def plan_buckets(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    bucket_bytes: int,
    first_bucket_bytes: int | None = None,
) -> list[BucketSpec]:
    """Group parameters (given in registration order) into buckets of at most
    ``bucket_bytes`` each; the first bucket of each dtype/device holds at most
    ``first_bucket_bytes`` (default ``min(1 MB, bucket_bytes)``). A tensor larger than
    its bucket's cap travels alone and closes its bucket at once, so a big layer whose
    gradient is ready early is exchanged while backward goes on."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    if not len(shapes) == len(dtypes) == len(devices):
        raise ValueError("shapes, dtypes and devices must have the same length")
    first = min(FIRST_BUCKET_BYTES if first_bucket_bytes is None else first_bucket_bytes,
                bucket_bytes)
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    cap_of: dict[tuple[torch.dtype, torch.device], int] = {}  # cap of the open bucket
    closed: list[list[int]] = []
    for i in reversed(range(len(shapes))):
        key = (dtypes[i], devices[i])
        size = int(torch.Size(shapes[i]).numel()) * torch.empty((), dtype=dtypes[i]).element_size()
        current = open_buckets.setdefault(key, [])
        if current and open_bytes[key] + size > cap_of[key]:
            closed.append(current)
            current = open_buckets[key] = []
        if not current:
            cap_of[key] = first if key not in cap_of else bucket_bytes
            open_bytes[key] = 0
        current.append(i)
        open_bytes[key] += size
        if size > cap_of[key] or size >= first:
            # A tensor of a megabyte or more is bandwidth-bound on its own: send it as soon
            # as it is ready instead of holding it for the smaller gradients after it.
            closed.append(current)
            open_buckets[key] = []
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
