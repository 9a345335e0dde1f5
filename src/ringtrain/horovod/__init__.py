"""A drop-in for ``horovod.torch``: ``import ringtrain.horovod as hvd``.

Horovod's names, signatures, defaults and semantics on ``torch.distributed``: named,
negotiated collectives in any order (:mod:`ringtrain.horovod._coordinator`), process sets,
``join``, differentiable ops, Adasum, ``DistributedOptimizer`` on ringtrain's fused
exchange, ``SyncBatchNorm``, the timeline and ``hvd.elastic``. docs/migrate.md lists
what differs. Beyond Horovod: ``hvd.LocalSGD`` and ``hvd.DiLoCo`` are ringtrain's
periodic exchange modes (``rt.LocalSGD``, ``rt.DiLoCo``; docs/lowcomm.md), over the
whole world.
"""

from __future__ import annotations

from typing import Any

from ringtrain.horovod._coordinator import ProcessSet
from ringtrain.horovod.autograd import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from ringtrain.horovod.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ringtrain.horovod.compression import Compression
from ringtrain.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ringtrain.horovod.handles import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    poll,
    synchronize,
)
from ringtrain.horovod.ops import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    reducescatter_async,
    sparse_allreduce_async,
)
from ringtrain.horovod.optimizer import DistributedOptimizer
from ringtrain.horovod.process_sets import add_process_set, remove_process_set
from ringtrain.horovod.sync_batch_norm import SyncBatchNorm
from ringtrain.lowcomm import DiLoCo, LocalSGD

__all__ = [
    "Adasum", "Average", "Compression", "DiLoCo", "DistributedOptimizer", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Max", "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "elastic", "gloo_built", "gloo_enabled", "global_process_set",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join", "LocalSGD", "local_rank",
    "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "run", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]


def __getattr__(name: str) -> Any:
    # hvd.elastic and hvd.HostsUpdatedInterrupt load on first use (the elastic module
    # pulls in the restart machinery a plain script does not need).
    if name == "elastic":
        import ringtrain.horovod.elastic as elastic

        return elastic
    if name == "run":  # Horovod's Python launcher (horovod.run)
        from ringtrain.horovod.runner import run

        return run
    if name == "HostsUpdatedInterrupt":
        from ringtrain.horovod.elastic import HostsUpdatedInterrupt

        return HostsUpdatedInterrupt
    raise AttributeError(f"module 'ringtrain.horovod' has no attribute {name!r}")
