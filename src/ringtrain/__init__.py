"""ringtrain: fast data-parallel PyTorch training on one machine and on many.

The public API (README.md; docs/architecture.md for the layers behind it), re-exported
from small private modules::

    import ringtrain as rt
    rt.init()
    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())

Names are resolved on first use (PEP 562), so ``import ringtrain`` is cheap and the
launcher (``ringtrain.launch``), which never needs torch, does not pay for importing it.
Importing registers and starts nothing; ``rt.init()`` wires the layers together
(:mod:`ringtrain.wiring`). ``_EXPORTS`` is the one list of public names; a test checks
that the ``TYPE_CHECKING`` imports below (for type checkers and IDEs) match it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None means the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "init": ("ringtrain.wiring", "init"),
    "shutdown": ("ringtrain.wiring", "shutdown"),
    **{name: ("ringtrain.runtime", name) for name in (
        "is_initialized", "rank", "size", "local_rank", "local_size",
        "cross_rank", "cross_size", "device",
    )},
    **{name: ("ringtrain.collectives", name) for name in (
        "ReduceOp", "Average", "Sum", "Min", "Max", "Handle", "barrier", "allreduce",
        "allreduce_", "allreduce_async", "allreduce_async_", "synchronize", "allgather",
        "broadcast", "broadcast_", "alltoall", "reducescatter", "broadcast_object",
        "allgather_object",
    )},
    "DistributedOptimizer": ("ringtrain.optimizer", "DistributedOptimizer"),
    "LocalSGD": ("ringtrain.lowcomm", "LocalSGD"),
    "DiLoCo": ("ringtrain.lowcomm", "DiLoCo"),
    "Compression": ("ringtrain.compression", "Compression"),
    "broadcast_parameters": ("ringtrain.replicate", "broadcast_parameters"),
    "broadcast_optimizer_state": ("ringtrain.replicate", "broadcast_optimizer_state"),
    "scale_lr": ("ringtrain.schedule", "scale_lr"),
    "warmup": ("ringtrain.schedule", "warmup"),
    "parallelize": ("ringtrain.parallel", "parallelize"),
    **{name: (f"ringtrain.{name}", None) for name in (
        "checkpoint", "data", "errors", "sync", "observe", "elastic", "parallel",
    )},
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ringtrain' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ringtrain import checkpoint, data, elastic, errors, observe, parallel, sync
    from ringtrain.collectives import (
        Average,
        Handle,
        Max,
        Min,
        ReduceOp,
        Sum,
        allgather,
        allgather_object,
        allreduce,
        allreduce_,
        allreduce_async,
        allreduce_async_,
        alltoall,
        barrier,
        broadcast,
        broadcast_,
        broadcast_object,
        reducescatter,
        synchronize,
    )
    from ringtrain.compression import Compression
    from ringtrain.lowcomm import DiLoCo, LocalSGD
    from ringtrain.optimizer import DistributedOptimizer
    from ringtrain.parallel import parallelize
    from ringtrain.replicate import broadcast_optimizer_state, broadcast_parameters
    from ringtrain.runtime import (
        cross_rank,
        cross_size,
        device,
        is_initialized,
        local_rank,
        local_size,
        rank,
        size,
    )
    from ringtrain.schedule import scale_lr, warmup
    from ringtrain.wiring import init, shutdown
