"""Every rank's object on rank 0 only: what :meth:`Resumable.save` collects.

Before, the save gathered each rank's state with ``collectives.allgather_object``, so every
rank received every rank's: with ``rt.LocalSGD``/``rt.DiLoCo`` (parameters and inner
optimizer state per rank) that was N copies of the model's state in each rank's memory
at every save, although only rank 0 writes the file (1 GB of local state on 8 ranks: 8 GB
more on each rank). Here only the pickled sizes (8 bytes per rank) go to every rank; the
bytes go to rank 0 alone (``dist.gather``), in tensors held until Gloo lets go of them
(:mod:`ringtrain.inflight`), like ringtrain's own collectives.

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

__all__ = ["gather_to_root"]


def _pickled(obj: Any, label: str, rank: int) -> tuple[bytes, str | None]:
    try:
        return pickle.dumps(obj), None
    except Exception as exc:  # noqa: BLE001 - pickle raises TypeError, PicklingError, AttributeError...
        return b"", f"gather of {label!r} on rank {rank} cannot pickle {type(obj).__name__}: {first_line(exc, None)}"


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
