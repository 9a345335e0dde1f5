"""Make every rank start from rank 0's model and optimizer state.

Tensors are packed into one flat buffer per dtype and device before the broadcast, so
a model of hundreds of tensors costs a few collectives instead of hundreds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ringtrain import runtime
from ringtrain.collectives import broadcast_, broadcast_object

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "broadcast_tensors_"]


def broadcast_tensors_(tensors: list[torch.Tensor], root_rank: int = 0, name: str = "tensors") -> None:
    """Broadcast ``tensors`` in place, fused by (dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _device), group in groups.items():
        flat = torch.cat([t.detach().reshape(-1) for t in group]) if group else torch.empty(0)
        broadcast_(flat, root_rank=root_rank, name=f"{name} ({dtype})")
        offset = 0
        with torch.no_grad():
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Iterable[torch.Tensor],
    root_rank: int = 0,
) -> None:
    """Overwrite the given tensors with root's values: a ``state_dict()``, ``named_parameters()``
    or a list of tensors."""
    runtime.world()
    items = params.items() if isinstance(params, Mapping) else params
    tensors: list[torch.Tensor] = []
    for item in items:
        t = item[1] if isinstance(item, tuple) else item
        if isinstance(t, torch.Tensor):
            tensors.append(t)
    broadcast_tensors_(tensors, root_rank, "parameters")


def _split_tensors(obj: Any, out: list[torch.Tensor]) -> Any:
    """Replace tensors in a nested structure by placeholders; collect them in ``out``."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        kind = obj.device.type
        return ("__tensor__", len(out) - 1, tuple(obj.shape), str(obj.dtype).split(".")[-1], kind)
    if isinstance(obj, dict):
        return {k: _split_tensors(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split_tensors(v, out) for v in obj)
    return obj


def _is_placeholder(obj: Any) -> bool:
    return isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "__tensor__"


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if _is_placeholder(obj):
        return tensors[obj[1]]
    if isinstance(obj, dict):
        return {k: _rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank root's optimizer state (moments, step counts, hyper-parameters).

    Ranks whose optimizer has not stepped yet (Adam creates state lazily) receive the
    full structure from root, so the call works at any point of training.
    """
    runtime.world()
    mine: list[torch.Tensor] = []
    skeleton = _split_tensors(optimizer.state_dict(), mine)
    skeleton = broadcast_object(skeleton if runtime.rank() == root_rank else None, root_rank,
                                name="optimizer state layout")
    if runtime.rank() == root_rank:
        tensors = mine
    else:
        specs: list[tuple[int, tuple[int, ...], str, str]] = []

        def collect(obj: Any) -> None:
            if _is_placeholder(obj):
                specs.append(obj[1:])
            elif isinstance(obj, dict):
                for v in obj.values():
                    collect(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    collect(v)

        collect(skeleton)
        tensors = [torch.empty(0)] * len(specs)
        for index, shape, dtype, kind in specs:
            # Root's CUDA state lands on this rank's own GPU; CPU state stays on the CPU.
            dev = runtime.device() if kind == "cuda" else torch.device("cpu")
            tensors[index] = torch.empty(shape, dtype=getattr(torch, dtype), device=dev)
    broadcast_tensors_(tensors, root_rank, "optimizer state")
    if runtime.rank() != root_rank:
        optimizer.load_state_dict(_rebuild(skeleton, tensors))
