"""``horovod.keras``'s module-level calls: ``init``, ranks, ``allreduce``, ``load_model``.

So a Keras script written for ``import horovod.keras as hvd`` runs with
``import ringtrain.keras as hvd``: these are the same calls on ringtrain's runtime.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ringtrain import collectives, runtime, wiring
from ringtrain.compression import Compression, Compressor
from ringtrain.keras._backend import load_keras
from ringtrain.keras.optimizer import GradientExchange, _distributed_class, _DistributedMixin

__all__ = ["Compression", "allreduce", "init", "load_model", "local_rank", "local_size", "rank", "size"]

keras = load_keras()


def init() -> None:
    """Join the job (``rt.init()``)."""
    wiring.init()


def size() -> int:
    return runtime.size()


def rank() -> int:
    return runtime.rank()


def local_rank() -> int:
    return runtime.local_rank()


def local_size() -> int:
    return runtime.local_size()


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, op: Any = None,
              compression: Compressor = Compression.none) -> Any:
    """Reduce a number, array or tensor over every rank (default: average); returns a
    backend tensor, as ``horovod.keras.allreduce``."""
    if op is None:
        op = collectives.Sum if average is False else collectives.Average
    t = torch.as_tensor(keras.ops.convert_to_numpy(value) if not isinstance(value, torch.Tensor) else value)
    if not t.is_floating_point():
        t = t.double() if (prescale_factor != 1.0 or postscale_factor != 1.0) else t
    t = t.detach().clone()
    if prescale_factor != 1.0:
        t = t * prescale_factor
    wire, ctx = compression.compress(t)
    out = compression.decompress(collectives.allreduce(wire, op=op, name=name), ctx)
    if postscale_factor != 1.0:
        out = out * postscale_factor
    return keras.ops.convert_to_tensor(out)


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

