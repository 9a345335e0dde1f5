"""horovod.torch's modules exist under ringtrain.horovod with the same objects: a script
or library that imports ``horovod.torch.mpi_ops`` (Horovod's own Adasum tests do) or
``horovod.torch.elastic.sampler`` changes the package name only."""

from __future__ import annotations

import importlib

import pytest

# What scripts import from horovod.torch.mpi_ops (Horovod 0.28.1's module namespace).
MPI_OPS = [
    "Adasum", "Average", "Compression", "HorovodInternalError", "Max", "Min", "Product", "ProcessSet",
    "Sum", "add_process_set", "allgather", "allgather_async", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "global_process_set", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init",
    "is_initialized", "join", "local_rank", "local_size", "poll", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "shutdown", "size", "sparse_allreduce_async",
    "synchronize",
]


def test_mpi_ops_holds_the_packages_own_objects() -> None:
    hvd = importlib.import_module("ringtrain.horovod")
    mpi_ops = importlib.import_module("ringtrain.horovod.mpi_ops")
    missing = [n for n in MPI_OPS if not hasattr(mpi_ops, n)]
    assert not missing
    assert all(getattr(mpi_ops, n) is getattr(hvd, n) for n in MPI_OPS)
    assert set(MPI_OPS) <= set(mpi_ops.__all__)


@pytest.mark.parametrize("name", ["compression", "functions", "optimizer", "sync_batch_norm",
                                  "elastic", "elastic.sampler", "elastic.state"])
def test_horovod_torch_module_paths_import(name: str) -> None:
    importlib.import_module(f"ringtrain.horovod.{name}")
