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

__version__ = "0.1.0"

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "Max",
    "Min",
    "ReduceOp",
    "Sum",
    "__version__",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "checkpoint",
    "cross_rank",
    "cross_size",
    "device",
    "errors",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "scale_lr",
    "shutdown",
    "size",
    "synchronize",
    "warmup",
]
