"""Horovod's helpers: start every rank from the root's parameters, optimizer state and
objects (``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``,
``allgather_object``), through the coordinator so process sets and names work as in
Horovod.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ringtrain import replicate
from ringtrain.horovod import ops
from ringtrain.horovod._coordinator import ProcessSet
from ringtrain.horovod.autograd import allgather, broadcast_
from ringtrain.horovod.basics import engine, global_process_set, rank
from ringtrain.horovod.handles import set_id, synchronize, unique_name

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite the given tensors with the root's: a ``state_dict()`` (sorted by name, as
    Horovod), ``named_parameters()`` or a list of tensors.

    An entry that is not a tensor (an int, a string, None) is a ValueError on every rank,
    as in Horovod (whose broadcast refuses it): it cannot be overwritten in place, and
    skipped it stayed different on each rank, silently."""
    if isinstance(params, Mapping):
        items: list[tuple[str | None, Any]] = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}")
    bad = next(((i, name, p) for i, (name, p) in enumerate(items) if not isinstance(p, torch.Tensor)), None)
    if bad is not None:
        # Before any is submitted, so that no tensor is overwritten on one rank only; the
        # other members get the error instead of waiting for these names.
        i, name, p = bad
        label = repr(name) if name is not None else f"entry {i}"
        exc = ValueError(f"broadcast_parameters overwrites tensors in place, and {label} is of type "
                         f"{type(p).__name__}, not a tensor; broadcast it with hvd.broadcast_object, "
                         "or leave it out")
        ops.refuse_names("broadcast", [n for n, _ in items], global_process_set,
                         f"broadcast_parameters on rank {rank()}: ValueError: {exc}")
        raise exc
    handles = []
    for i, (name, p) in enumerate(items):
        try:
            handles.append(ops.broadcast_async_(p, root_rank, name))
        except Exception as exc:
            # broadcast_async_ refused this one to the other ranks; the rest were left
            # pending there for ever (and their names taken): refuse them too.
            text = f"broadcast_parameters on rank {rank()}: {type(exc).__name__}: {exc}"
            ops.refuse_names("broadcast", [n for n, _ in items[i + 1:]], global_process_set, text)
            raise
    failed: Exception | None = None
    for h in handles:  # every one, so that none is left pending after an error
        try:
            synchronize(h)
        except Exception as exc:  # noqa: BLE001 - the first is raised below
            failed = failed or exc
    if failed is not None:
        raise failed


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    try:
        pickle.dump(obj, buf)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle  # lambdas and local classes, as Horovod pickles them

        buf = io.BytesIO()
        cloudpickle.dump(obj, buf)
    return buf.getvalue()


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """The root's ``obj`` on every member (pickled, sent as bytes)."""
    engine()  # before hvd.init(): Horovod's "not initialized" error, not the set's
    base = name if name is not None else unique_name("object", None, set_id(process_set))
    if rank() == root_rank:
        size = torch.zeros(1, dtype=torch.int64)
        try:
            payload = _dumps(obj)
        except Exception as exc:
            # The other members were left waiting for the size for ever (no stall limit
            # by default): they get the root's error instead.
            ops.refuse("broadcast", size, f"{base}.sz", process_set,
                       f"broadcast_object: the root (rank {root_rank}) cannot pickle its object: "
                       f"{type(exc).__name__}: {exc}", root=root_rank)
            raise
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        size[0] = data.numel()
        broadcast_(size, root_rank, f"{base}.sz", process_set)
        broadcast_(data, root_rank, f"{base}.t", process_set)
        return obj
    size = torch.zeros(1, dtype=torch.int64)
    broadcast_(size, root_rank, f"{base}.sz", process_set)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, f"{base}.t", process_set)
    return pickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every member's ``obj``, in rank order."""
    engine()  # before hvd.init(): Horovod's "not initialized" error, not the set's
    base = name if name is not None else unique_name("object_gather", None, set_id(process_set))
    try:
        payload = _dumps(obj)
    except Exception as exc:
        # As in broadcast_object: the other members get this rank's error, not a wait.
        ops.refuse("allgather", torch.zeros(1, dtype=torch.int64), f"{base}.sz", process_set,
                   f"allgather_object: rank {rank()} cannot pickle its object: {type(exc).__name__}: {exc}")
        raise
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), f"{base}.sz", process_set)
    gathered = allgather(data, f"{base}.t", process_set)
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(gathered[offset:offset + n].numpy().tobytes()))
        offset += n
    return out


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Give every rank the root's optimizer state and hyper-parameters.

    As Horovod: an optimizer that has no state yet gets it first by one update with zero
    gradients (so its state has the same structure everywhere); the parameters that
    require a gradient keep those zero gradients. Unlike Horovod, that update leaves the
    parameters where they were: with weight decay it moves them (Adam's by about lr), and
    in the resume recipe (the root loaded a checkpoint, the others start empty) only the
    other ranks take it, so their parameters would differ from the root's for the rest
    of the run. Then the root's state (tensors and
    option values, with their types) replaces every other rank's
    (:func:`ringtrain.replicate.broadcast_optimizer_state`), through the wrapped
    optimizer, so a DistributedOptimizer keeps sharing it.
    """
    engine()  # before hvd.init(): Horovod's "not initialized" error
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    from ringtrain.horovod.optimizer import _AdasumOptimizer
    from ringtrain.optimizer import DistributedOptimizer as _Core

    inner = optimizer.wrapped if isinstance(optimizer, _Core) else optimizer
    if isinstance(optimizer, _AdasumOptimizer):
        # Its step() combines the update with Adasum over the ranks: the state-building
        # step below, taken only by the ranks without a state (a resume where rank 0
        # loaded a checkpoint), waited for an allreduce the others never submit.
        inner = optimizer.__dict__["_inner"]
    from ringtrain.lowcomm import PeriodicSync

    # hvd.DiLoCo / hvd.LocalSGD: root's state as is. They are torch optimizers (for the
    # schedulers), but their step() is collective and counts the sync schedule: the
    # state-building step below would shift it, or wait for ranks that never take it.
    if isinstance(inner, PeriodicSync) or not isinstance(inner, torch.optim.Optimizer):
        replicate.broadcast_optimizer_state(inner, root_rank)
        return
    if not inner.state_dict()["state"]:
        sparse = {id(p) for m in (model.modules() if model is not None else ())
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
        for group in inner.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    if isinstance(inner, torch.optim.SparseAdam) or id(p) in sparse:
                        p.grad = p.grad.to_sparse()
        kept = [(p, p.detach().clone()) for group in inner.param_groups for p in group["params"]
                if p.requires_grad]
        inner.step()  # the wrapped optimizer's own step: no exchange, no rank waits
        with torch.no_grad():
            for p, before in kept:
                p.copy_(before)
    # ringtrain's broadcast: the layout once, the tensors fused by dtype.
    replicate.broadcast_optimizer_state(inner, root_rank)
