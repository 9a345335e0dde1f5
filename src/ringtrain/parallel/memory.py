"""Measure what a rank holds for training state: parameters, gradients, optimizer state.

The figure is *measured*, not estimated from parameter counts: it is the size of the
storages those tensors actually occupy on this rank (the local shard of a DTensor,
with FSDP2's padding; a storage shared by several tensors, such as FSDP2's flat
gradient buffer, counted once). It does not depend on what else the process holds,
so unlike RSS it can be compared across ranks and layouts to a few bytes. On CUDA the
caching allocator's own counter (``torch.cuda.memory_allocated``) is reported beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StateMemory", "state_memory"]


@dataclass(frozen=True)
class StateMemory:
    """Bytes of training state on one rank."""

    parameters: int
    gradients: int
    optimizer: int
    #: ``torch.cuda.memory_allocated`` of the parameters' device at the time of
    #: measuring (None off CUDA).
    cuda_allocated: int | None = None

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def mib(self) -> float:
        return self.total / 2**20


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: its shard on this rank
    return to_local() if callable(to_local) else t


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    total = 0
    for t in tensors:
        local = _local(t)
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def state_memory(parameters: Iterable[torch.nn.Parameter],
                 optimizer: torch.optim.Optimizer | None = None) -> StateMemory:
    """Bytes this rank holds for ``parameters``, their gradients and ``optimizer``'s state."""
    params = list(parameters)
    seen: set[tuple[str, int]] = set()
    p_bytes = _bytes(params, seen)
    g_bytes = _bytes((p.grad for p in params if p.grad is not None), seen)
    o_bytes = 0
    if optimizer is not None:
        o_bytes = _bytes(_tensors(list(optimizer.state.values())), seen)
    cuda = None
    on_cuda = next((_local(p).device for p in params if _local(p).is_cuda), None)
    if on_cuda is not None:
        # The parameters' device, not the current one (a module placed on cuda:1 in a
        # process whose current device is 0 reported cuda:0's counter).
        cuda = torch.cuda.memory_allocated(on_cuda)
    return StateMemory(p_bytes, g_bytes, o_bytes, cuda)
