"""``horovod.keras``'s module-level calls: ``init``, ranks, collectives, ``load_model``.

So a Keras script written for ``import horovod.keras as hvd`` runs with
``import ringtrain.keras as hvd``: these are the same calls on ringtrain's runtime.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ringtrain import collectives, runtime, wiring
from ringtrain.collectives import Average, ReduceOp, Sum
from ringtrain.compression import Compression, Compressor
from ringtrain.horovod.basics import global_process_set
from ringtrain.keras._backend import load_keras
from ringtrain.keras.optimizer import GradientExchange, _distributed_class, _DistributedMixin, whole_job

__all__ = [
    "Average", "Compression", "Sum", "allgather", "allreduce", "broadcast", "cross_rank", "cross_size",
    "global_process_set",
    "init", "is_initialized", "load_model", "local_rank", "local_size", "rank", "reducescatter",
    "shutdown", "size",
]

keras = load_keras()


def init() -> None:
    """Join the job (``rt.init()``)."""
    wiring.init()


def shutdown() -> None:
    """Leave the job (``rt.shutdown()``)."""
    wiring.shutdown()


def is_initialized() -> bool:
    return runtime.is_initialized()


def size() -> int:
    return runtime.size()


def rank() -> int:
    return runtime.rank()


def local_rank() -> int:
    return runtime.local_rank()


def local_size() -> int:
    return runtime.local_size()


def cross_rank() -> int:
    return runtime.cross_rank()


def cross_size() -> int:
    return runtime.cross_size()


def _as_torch(value: Any) -> torch.Tensor:
    """A number, list, NumPy array or backend tensor as a torch tensor of its own."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return torch.as_tensor(keras.ops.convert_to_numpy(value))


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Compressor = Compression.none, process_set: Any = None) -> Any:
    """Reduce a number, array or tensor over every rank (default: average); returns a
    backend tensor, as ``horovod.keras.allreduce``. ``process_set``: the global one only."""
    whole_job(process_set, "allreduce")
    if op is None:
        op = collectives.Sum if average is False else collectives.Average
    t = _as_torch(value)
    if not t.is_floating_point():
        t = t.double() if (prescale_factor != 1.0 or postscale_factor != 1.0) else t
    if prescale_factor != 1.0:
        t = t * prescale_factor
    wire, ctx = compression.compress(t)
    out = compression.decompress(collectives.allreduce(wire, op=op, name=name), ctx)
    if postscale_factor != 1.0:
        out = out * postscale_factor
    return keras.ops.convert_to_tensor(out)


def allgather(value: Any, name: str | None = None, process_set: Any = None) -> Any:
    """Concatenate every rank's value along the first dimension (sizes may differ), as
    ``horovod.keras.allgather``; a scalar counts as one row."""
    whole_job(process_set, "allgather")
    return keras.ops.convert_to_tensor(collectives.allgather(_as_torch(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None, process_set: Any = None) -> Any:
    """``root_rank``'s value on every rank, as ``horovod.keras.broadcast`` (e.g. the epoch
    to resume from, which only rank 0 found)."""
    whole_job(process_set, "broadcast")
    return keras.ops.convert_to_tensor(collectives.broadcast(_as_torch(value), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: ReduceOp = Average,
                  process_set: Any = None) -> Any:
    """Reduce over ranks and keep this rank's share of the first dimension."""
    whole_job(process_set, "reducescatter")
    return keras.ops.convert_to_tensor(collectives.reducescatter(_as_torch(value), op=op, name=name))


def load_model(filepath: str | os.PathLike[str], custom_optimizers: list[type] | None = None,
               custom_objects: dict[str, Any] | None = None,
               compression: Compressor = Compression.none) -> Any:
    """Load a saved Keras model and make its optimizer (with its state) distributed."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is not None and not isinstance(opt, _DistributedMixin):
        # The loaded optimizer keeps its variables; it becomes an instance of the
        # distributed subclass of its own class and gets an exchange.
        opt.__class__ = _distributed_class(type(opt))
        object.__setattr__(opt, "_ringtrain_exchange", GradientExchange(compression))
    return model

