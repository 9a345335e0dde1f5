"""ringtrain: fast data-parallel PyTorch training on one machine and on many.

The public API (see DESIGN.md); everything is re-exported from small private modules::

    import ringtrain as rt
    rt.init()
    opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
"""

from __future__ import annotations

from ringtrain import checkpoint, errors
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
from ringtrain.replicate import broadcast_optimizer_state, broadcast_parameters
from ringtrain.compression import Compression
from ringtrain.optimizer import DistributedOptimizer
from ringtrain.schedule import scale_lr, warmup
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

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "device",
    "ReduceOp", "Average", "Sum", "Min", "Max", "Handle",
    "barrier", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "synchronize",
    "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "broadcast_object", "allgather_object",
    "DistributedOptimizer", "Compression", "broadcast_parameters", "broadcast_optimizer_state",
    "scale_lr", "warmup",
    "checkpoint", "errors",
]
