"""Gradient clipping by the whole model's norm, whatever the layout.

``torch.nn.utils.clip_grad_norm_`` over one rank's parameters sees only what the rank
holds: with a pipeline, its stage (each stage would be clipped by its own norm), and
with tensor parallelism a mix of split (DTensor) and whole layers, which torch refuses.
Here each rank adds up its share of ``sum |g|^p`` and one all-reduce over the world
makes the whole model's. A rank's share counts each gradient element once over the
world: an element that ``k`` ranks of its stage hold (a layer outside the tensor plan
is whole on every tensor rank; ``shard=False`` keeps every element on every data rank)
adds ``|g|^p / k`` on each of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import inflight
from ringtrain.errors import ConfigError

__all__ = ["clip_grad_norm"]


def _local_share(grad: torch.Tensor, holders: int, p: float) -> torch.Tensor:
    """This rank's part of ``sum |g|^p`` (``max |g|`` for p = inf), in float64 on the
    gradient's device (no copy to the host: on CUDA each ``.cpu()`` here was a device
    synchronisation per gradient, every step)."""
    from torch.distributed.tensor import DTensor, Replicate

    shards = 1
    if isinstance(grad, DTensor):
        if any(pl.is_partial() for pl in grad.placements):
            grad = grad.redistribute(placements=[
                Replicate() if pl.is_partial() else pl for pl in grad.placements])
        for size, pl in zip(grad.device_mesh.shape, grad.placements, strict=True):
            # (Not pl.is_shard(): FSDP2 over a tensor-parallel split is a _StridedShard,
            # which is not a Shard.)
            shards *= 1 if pl.is_replicate() else size
        grad = grad.to_local()
    local = grad.detach().to(torch.float64).abs()
    if local.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=local.device)
    if p == float("inf"):
        return local.max()
    return local.pow(p).sum() / (holders // shards)


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float,
                   norm_type: float = 2.0, *, holders: int = 1,
                   device: torch.device | None = None) -> float:
    """Clip this rank's gradients by the norm of every rank's; returns that norm.

    ``holders``: the ranks that hold this rank's stage (data x tensor degree).
    ``device``: where the all-reduce over the world runs; None for one process.
    The scaling is ``torch.nn.utils.clip_grad_norm_``'s: ``max_norm / (norm + 1e-6)``
    when that is below 1.
    """
    p = float(norm_type)
    if not p > 0:
        raise ConfigError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type!r}")
    grads = [q.grad for q in parameters if q.grad is not None]
    inf = p == float("inf")
    # Summed on each gradient's device, then moved once per device to where the
    # all-reduce runs (the host for one process): the norm's float() below is the one
    # host synchronisation of the step's clipping.
    per_device: dict[torch.device, torch.Tensor] = {}
    for grad in grads:
        share = _local_share(grad, holders, p)
        held = per_device.get(share.device)
        per_device[share.device] = share if held is None else (
            torch.maximum(held, share) if inf else held + share)
    total = torch.zeros((), dtype=torch.float64, device=device if device is not None else "cpu")
    for share in per_device.values():
        share = share.to(total.device)
        total = torch.maximum(total, share) if inf else total + share
    if device is not None:
        inflight.hold(total)
        dist.all_reduce(total, op=dist.ReduceOp.MAX if p == float("inf") else dist.ReduceOp.SUM)
    norm = float(total) if p == float("inf") else float(total) ** (1.0 / p)
    coef = max_norm / (norm + 1e-6)
    # A NaN norm scales every gradient by NaN, as torch's clamp(coef, max=1) does, so a
    # non-finite step shows on every parameter (not only where the NaN arose).
    if coef < 1.0 or math.isnan(coef):
        for grad in grads:
            grad.detach().mul_(coef)
    return norm
