"""Make every rank start from rank 0's model and optimizer state.

Tensors are packed into one flat buffer per dtype and device before the broadcast, so
a model of hundreds of tensors costs a few collectives instead of hundreds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ringtrain import runtime
from ringtrain.collectives import Max, allgather_object, allreduce_, broadcast_, broadcast_object
from ringtrain.errors import MismatchError

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "broadcast_tensors_"]


def _layout(tensors: list[torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    return [(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in tensors]


def _check_layout(tensors: list[torch.Tensor], root_rank: int, name: str, problem: str | None = None) -> None:
    """Every rank passes tensors of the same shapes and dtypes, in the same order, or
    every rank raises the same MismatchError before any tensor is overwritten.

    The fused buffers only compare their total lengths: a (3, 2) tensor where the root
    has (2, 3), or two tensors of one dtype in another order, took the root's values
    reshaped or swapped, silently (Horovod, broadcasting each tensor by name, refuses
    the first). One small allreduce of a digest of the layout, which also carries
    whether some rank refuses what it was given (``problem``): then every rank raises
    that ValueError, and none waits for a broadcast that rank will not join."""
    if runtime.size() == 1:
        if problem is not None:
            raise ValueError(problem)
        return
    layout = _layout(tensors)
    code = int.from_bytes(hashlib.sha1(repr(layout).encode(), usedforsecurity=False).digest()[:7], "big")
    bounds = torch.tensor([code, -code, int(problem is not None)], dtype=torch.int64)
    allreduce_(bounds, op=Max, name=f"{name} (layout check)")
    if int(bounds[2]):
        # Every rank saw that one refuses: gathering the reasons to name it is safe.
        problems = allgather_object(problem, name=f"{name} (refusals)")
        if problem is not None:
            raise ValueError(problem)
        rank = next(r for r, p in enumerate(problems) if p is not None)
        raise ValueError(f"broadcast of {name}: rank {rank} refused it: {problems[rank]}")
    if int(bounds[0]) == -int(bounds[1]):
        return
    # Every rank saw the mismatch: gathering the layouts to name it is safe.
    layouts = allgather_object(layout, name=f"{name} (layouts)")
    root = root_rank if isinstance(root_rank, int) and 0 <= root_rank < len(layouts) else 0
    want = layouts[root]
    for rank, got in enumerate(layouts):
        if got == want:
            continue
        if len(got) != len(want):
            what = f"{len(got)} tensors where rank {root} (the root) passes {len(want)}"
        else:
            i = next(k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            what = (f"tensor {i} as {got[i][1]} {got[i][0]} where rank {root} (the root) passes "
                    f"{want[i][1]} {want[i][0]}")
        raise MismatchError(f"broadcast of {name}: rank {rank} passes {what}; every rank must pass "
                            "the same tensors (shapes, dtypes) in the same order: build the same "
                            "model on every rank before broadcasting its state")


def broadcast_tensors_(tensors: list[torch.Tensor], root_rank: int = 0, name: str = "tensors") -> None:
    """Broadcast ``tensors`` in place, fused by (dtype, device); the ranks' shapes and
    dtypes are compared first (see :func:`_check_layout`)."""
    _broadcast(tensors, root_rank, name, None)


def _broadcast(tensors: list[torch.Tensor], root_rank: int, name: str, problem: str | None) -> None:
    _check_layout(tensors, root_rank, name, problem)
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
    or a list of tensors.

    Anything else is a ValueError on every rank before any tensor is overwritten, as
    Horovod refuses it: a module (an ``nn.Sequential`` iterates over its layers, so it
    broadcast nothing and each rank kept its own initial weights), or an entry that is
    not a tensor (an epoch count in a dict: each rank kept its own, silently)."""
    runtime.world()
    problem: str | None = None
    items: Iterable[Any]
    if isinstance(params, torch.nn.Module):
        items = []
        problem = (f"broadcast_parameters takes a state_dict(), named_parameters() or a list of tensors, "
                   f"not a module ({type(params).__name__}); pass model.state_dict(), which has its "
                   "parameters and buffers (BatchNorm's running statistics)")
    elif isinstance(params, Mapping):
        # In the order of the names, as Horovod does: a state_dict whose modules were
        # registered in another order on some rank (built from a set, whose order
        # changes with each process's hash seed) still pairs each tensor with its own.
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable):
        items = params
    else:
        items = []
        problem = (f"broadcast_parameters takes a state_dict(), named_parameters() or a list of tensors, "
                   f"not {type(params).__name__}")
    tensors: list[torch.Tensor] = []
    for i, item in enumerate(items):
        label, t = (repr(item[0]), item[1]) if isinstance(item, tuple) and len(item) == 2 else (f"entry {i}", item)
        if isinstance(t, torch.Tensor):
            tensors.append(t)
        elif problem is None:
            problem = (f"broadcast_parameters overwrites tensors in place, and {label} is of type "
                       f"{type(t).__name__}, not a tensor; broadcast it with rt.broadcast_object, or leave it out")
    _broadcast(tensors, root_rank, "parameters", problem)


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
