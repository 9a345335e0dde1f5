"""Sharded data parallelism (ZeRO-3) with PyTorch's FSDP2 (``fully_shard``).

Each unit (an embedding, a transformer block, the head) becomes one FSDP group, then
the root: a group's parameters are all-gathered just before its forward (and again
before its backward), and its gradients reduce-scattered right after its backward,
so only one unit is ever whole (Rajbhandari et al. 2020, ZeRO stage 3; Zhao et al.
2023, PyTorch FSDP). Between steps each rank holds 1/N of the parameters, gradients
and optimizer state.

Replicated data parallelism (``shard=False``) is FSDP2's hybrid mode on a
``(replicate=N, shard=1)`` mesh: nothing is split, gradients are all-reduced,
one code path for both.

The gather and scatter are timed through FSDP2's own extension point
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``) and published on
:mod:`ringtrain.events` as ``shard_comm`` spans, which the step meter shows as their
own share of the step. The collectives themselves are the ones FSDP2 would call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import events

__all__ = ["SHARD_EVENT", "apply_fsdp", "timed_comms"]

#: Event kind of one all-gather or reduce-scatter (see :mod:`ringtrain.observe.meter`).
SHARD_EVENT = "shard_comm"


def _comm_base() -> tuple[type, type] | None:
    try:  # the interfaces of set_custom_all_gather / set_custom_reduce_scatter
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:  # an older torch: FSDP works, its traffic is not timed
        return None
    return AllGather, ReduceScatter


def timed_comms() -> tuple[Any, Any] | None:
    """An (all-gather, reduce-scatter) pair that publishes its durations, or None."""
    bases = _comm_base()
    if bases is None:
        return None
    all_gather_base, reduce_scatter_base = bases
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def allocate(self: Any, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def all_gather(self: Any, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                   group: dist.ProcessGroup, async_op: bool = False) -> Any:
        t0 = time.perf_counter()
        work = gather(output_tensor, input_tensor, group=group, async_op=async_op)
        # FSDP2 runs these synchronously on CPU (Gloo), so the span is the collective;
        # an asynchronous launch (CUDA) is the host time it blocked, as the meter sees it.
        events.emit(SHARD_EVENT, t0, time.perf_counter(), op="all_gather",
                    bytes=output_tensor.numel() * output_tensor.element_size())
        return work

    def reduce_scatter(self: Any, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                       group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        t0 = time.perf_counter()
        work = scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        events.emit(SHARD_EVENT, t0, time.perf_counter(), op="reduce_scatter",
                    bytes=input_tensor.numel() * input_tensor.element_size())
        return work

    timed_gather = type("TimedAllGather", (all_gather_base,),
                        {"allocate": allocate, "__call__": all_gather})
    timed_scatter = type("TimedReduceScatter", (reduce_scatter_base,),
                         {"allocate": allocate, "__call__": reduce_scatter})
    return timed_gather(), timed_scatter()


def _tied_units(units: Sequence[nn.Module]) -> set[int]:
    """Indices of the units that share a parameter with another unit."""
    owner: dict[int, int] = {}
    tied: set[int] = set()
    for i, unit in enumerate(units):
        for p in unit.parameters():
            first = owner.setdefault(id(p), i)
            if first != i:
                tied.update((first, i))
    return tied


def apply_fsdp(root: nn.Module, units: Sequence[nn.Module], mesh: Any, *,
               reshard_after_forward: bool) -> None:
    """``fully_shard`` each unit that has parameters, then ``root``, over ``mesh``.

    ``mesh`` is the 1-D data mesh (sharded) or the 2-D ``(replicate, shard)`` mesh.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    comms = timed_comms()
    sharded: list[Any] = []
    tied = _tied_units(units)
    for i, unit in enumerate(units):
        # A unit sharing a parameter with another unit (an embedding tied to the output
        # layer) is left to the root's group: FSDP2 refuses, at the first forward, a
        # parameter that two sibling groups manage. The tied units stay whole during
        # the forward and backward, as the root's own parameters do.
        if i not in tied and any(True for _ in unit.parameters()):
            sharded.append(fully_shard(unit, mesh=mesh,
                                       reshard_after_forward=reshard_after_forward))
    sharded.append(fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward))
    if comms is None:
        return
    gather, scatter = comms
    for module in sharded:
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
