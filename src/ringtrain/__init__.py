"""ringtrain: fast data-parallel PyTorch training on one machine and on many.

The public API (see DESIGN.md), re-exported from small private modules::

    import ringtrain as rt
    rt.init()
    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())

Names are resolved on first use (PEP 562), so ``import ringtrain`` is cheap and the
launcher (``ringtrain.launch``), which never needs torch, does not pay for importing it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> (module, attribute); attribute None means the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    **{name: ("ringtrain.runtime", name) for name in (
        "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
        "cross_rank", "cross_size", "device",
    )},
    **{name: ("ringtrain.collectives", name) for name in (
        "ReduceOp", "Average", "Sum", "Min", "Max", "Handle", "barrier", "allreduce",
        "allreduce_", "allreduce_async", "allreduce_async_", "synchronize", "allgather",
        "broadcast", "broadcast_", "alltoall", "reducescatter", "broadcast_object",
        "allgather_object",
    )},
    "DistributedOptimizer": ("ringtrain.optimizer", "DistributedOptimizer"),
    "Compression": ("ringtrain.compression", "Compression"),
    "broadcast_parameters": ("ringtrain.replicate", "broadcast_parameters"),
    "broadcast_optimizer_state": ("ringtrain.replicate", "broadcast_optimizer_state"),
    "scale_lr": ("ringtrain.schedule", "scale_lr"),
    "warmup": ("ringtrain.schedule", "warmup"),
    **{name: (f"ringtrain.{name}", None) for name in (
        "checkpoint", "data", "errors", "sync", "observe", "elastic", "runtime", "events",
    )},
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ringtrain' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    if attr is not None or name in ("data", "checkpoint", "elastic"):
        # Plug-ins wire themselves in on import: the step meter subscribes to the event
        # bus (so `ringtrain doctor` and RINGTRAIN_TIMELINE need no code changes) and the
        # ring / ps allreduce algorithms register their names.
        importlib.import_module("ringtrain.observe")
        importlib.import_module("ringtrain.sync")
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ringtrain import checkpoint, data, elastic, errors, events, observe, runtime, sync
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
    from ringtrain.optimizer import DistributedOptimizer
    from ringtrain.replicate import broadcast_optimizer_state, broadcast_parameters
    from ringtrain.runtime import (
        cross_rank,
        cross_size,
        device,
        init,
        is_initialized,
        local_rank,
        local_size,
        rank,
        shutdown,
        size,
    )
    from ringtrain.schedule import scale_lr, warmup
