"""Per-rank objects between rank 0 and the ranks, without every rank receiving every
rank's: what :class:`Resumable` saves and resumes.

:func:`gather_to_root` collects each rank's object on rank 0 alone (``dist.gather``) and
:func:`scatter_from_root` hands each rank its own from rank 0 (``dist.scatter``). With
``allgather_object``/``broadcast_object`` every rank would hold every rank's: with
``rt.LocalSGD``/``rt.DiLoCo`` (parameters and inner optimizer state per rank) N copies
of the model's state in each rank's memory (1 GB of local state on 8 ranks: 8 GB more
on each). Only the pickled sizes (8 bytes per rank) go to every rank; the bytes travel
in tensors held until Gloo lets go of them (:mod:`ringtrain.inflight`), like
ringtrain's own collectives.

An object some rank cannot pickle is the same one-line ConfigError on every rank, as
with ``allgather_object``.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import collectives, inflight, runtime
from ringtrain.errors import CollectiveError, ConfigError, first_line

__all__ = ["gather_to_root", "scatter_from_root"]


def _pickled(obj: Any, label: str, rank: int, verb: str = "gather") -> tuple[bytes, str | None]:
    try:
        return pickle.dumps(obj), None
    except Exception as exc:  # noqa: BLE001 - pickle raises TypeError, PicklingError, AttributeError...
        return b"", f"{verb} of {label!r} on rank {rank} cannot pickle {type(obj).__name__}: {first_line(exc, None)}"


def gather_to_root(obj: Any, name: str) -> list[Any] | None:
    """Every rank's ``obj`` by rank on rank 0 (each unpickled from its bytes, rank 0's own
    too, so the list is what ``allgather_object`` gave there); None on the other ranks.
    Every rank must call it."""
    size, rank = runtime.size(), runtime.rank()
    if size == 1:
        return [obj]
    raw, problem = _pickled(obj, name, rank)
    # -1: this rank could not pickle; every rank then learns why (a few bytes each).
    mine = torch.tensor([len(raw) if problem is None else -1], dtype=torch.int64)
    lengths = collectives.allgather(mine, name=f"{name} (sizes)").tolist()
    if min(lengths) < 0:
        reasons = collectives.allgather_object(problem, name=f"{name} (errors)")
        raise ConfigError("; ".join(r for r in reasons if r))
    # Padded to the longest, as dist.gather wants one shape (the ranks' states differ by
    # a few bytes at most: the same model and optimizer everywhere).
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    if raw:
        padded[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    del raw
    send = collectives.staged(padded)
    outs = [torch.empty_like(send) for _ in range(size)] if rank == 0 else None
    inflight.hold(send, *(outs or []))
    try:
        dist.gather(send, gather_list=outs, dst=0)
    except RuntimeError as exc:
        raise CollectiveError(f"gather of {name!r} failed on rank {rank}: {first_line(exc, None)}") from exc
    if outs is None:
        return None
    return [pickle.loads(out[:n].cpu().numpy().tobytes()) for out, n in zip(outs, lengths, strict=True)]


def scatter_from_root(objs: list[Any] | None, name: str) -> Any:
    """Rank ``r``'s object of rank 0's ``objs`` (one per rank, by rank), on each rank;
    the other ranks pass None. Every rank must call it."""
    size, rank = runtime.size(), runtime.rank()
    if rank == 0 and (objs is None or len(objs) != size):
        raise ValueError(f"scatter of {name!r}: rank 0 must pass one object per rank ({size})")
    if size == 1:
        return objs[0] if objs is not None else None
    raws: list[bytes] = []
    problem: str | None = None
    if rank == 0 and objs is not None:
        for r, obj in enumerate(objs):
            raw, problem = _pickled(obj, f"{name} for rank {r}", 0, "scatter")
            if problem is not None:
                break
            raws.append(raw)
    # Rank 0's sizes (the others' placeholder is overwritten); -1: it could not pickle one.
    mine = [-1] * size if problem is not None else [len(r) for r in raws] or [0] * size
    sizes = torch.tensor(mine, dtype=torch.int64)
    lengths = collectives.broadcast(sizes, root_rank=0, name=f"{name} (sizes)").tolist()
    if min(lengths) < 0:
        raise ConfigError(collectives.broadcast_object(problem, root_rank=0, name=f"{name} (errors)"))
    # Padded to the longest, as dist.scatter wants one shape (the ranks' states differ by
    # a few bytes at most: the same model and optimizer everywhere).
    longest = max(max(lengths), 1)
    outs: list[torch.Tensor] | None = None
    if rank == 0:
        outs = []
        for raw in raws:
            padded = torch.zeros(longest, dtype=torch.uint8)
            if raw:
                padded[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            outs.append(collectives.staged(padded))
        raws.clear()
    recv = collectives.staged(torch.empty(longest, dtype=torch.uint8))
    inflight.hold(recv, *(outs or []))
    try:
        dist.scatter(recv, scatter_list=outs, src=0)
    except RuntimeError as exc:
        raise CollectiveError(f"scatter of {name!r} failed on rank {rank}: {first_line(exc, None)}") from exc
    return pickle.loads(recv[: lengths[rank]].cpu().numpy().tobytes())
