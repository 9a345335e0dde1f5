"""``horovod.torch``'s synchronous collectives, differentiable as Horovod's are.

The gradients follow Horovod's definitions (so scripts and tests written for it get
the same numbers): allreduce's gradient is the same allreduce of the incoming gradient;
allgather's is the average of the incoming gradients, sliced to this rank's rows;
broadcast's is that average on the root and zero elsewhere; alltoall's sends the
gradient back along the received splits; reducescatter's gathers it (times the set
size for Sum, times the scale factors). A check made here, before the ``*_async``
call, that fails on one rank refuses the operation to the others (``ops.prechecks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringtrain.horovod import ops
from ringtrain.horovod._coordinator import ProcessSet
from ringtrain.horovod.basics import global_process_set, rank
from ringtrain.horovod.compression import Compression, Compressor
from ringtrain.horovod.handles import (
    Average,
    Sum,
    check_tensor,
    handle_average_backwards_compatibility,
    synchronize,
)

__all__ = ["allgather", "allreduce", "allreduce_", "alltoall", "broadcast", "broadcast_",
           "grouped_allgather", "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter",
           "reducescatter"]


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, name: str | None, pre: float, post: float,
                ps: ProcessSet) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return synchronize(ops.allreduce_async(tensor, None, name, op, pre, post, ps))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        return _Allreduce.apply(grad, op, None, pre, post, ps), None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Compressor = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce a copy of ``tensor`` over the process set (default: average)."""
    with ops.prechecks("allreduce", name, process_set):
        op = handle_average_backwards_compatibility(op, average)
        check_tensor("allreduce", tensor)
        wire, ctx = compression.compress(tensor)
    out = _Allreduce.apply(wire, op, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place; returns it."""
    return synchronize(ops.allreduce_async_(tensor, average, name, op, prescale_factor,  # type: ignore[no-any-return]
                                            postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: int, name: str | None, pre: float, post: float, ps: ProcessSet,
                *tensors: torch.Tensor) -> Any:
        ctx.args = (op, pre, post, ps)
        return tuple(synchronize(ops.grouped_allreduce_async(list(tensors), None, name, op, pre, post, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        return (None, None, None, None, None,
                *_GroupedAllreduce.apply(op, None, pre, post, ps, *grads))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Compressor = Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    tensors = list(tensors)  # a generator is read once
    with ops.prechecks("allreduce", name, process_set, group=tensors):
        op = handle_average_backwards_compatibility(op, average)
        for t in tensors:
            check_tensor("grouped_allreduce", t)
        packed = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(op, name, prescale_factor, postscale_factor, process_set,
                                   *[w for w, _ in packed])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed, strict=True)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: int | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(ops.grouped_allreduce_async_(tensors, average, name, op, prescale_factor,  # type: ignore[no-any-return]
                                                    postscale_factor, process_set))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.ps = (tensor.shape[0] if tensor.dim() else 1), ps
        return synchronize(ops.allgather_async(tensor, name, ps))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ps = ctx.ps
        reduced = _Allreduce.apply(grad, Average, None, 1.0, 1.0, ps)
        rows = synchronize(ops.allgather_async(torch.tensor([ctx.rows], dtype=torch.int64), None, ps))
        offset = int(rows[: ps.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along dim 0 (first dimensions may differ)."""
    with ops.prechecks("allgather", name, process_set):
        check_tensor("allgather", tensor)
    return _Allgather.apply(tensor, name, process_set)  # type: ignore[no-any-return]


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, ps: ProcessSet, *tensors: torch.Tensor) -> Any:
        ctx.rows, ctx.ps = [t.shape[0] if t.dim() else 1 for t in tensors], ps
        return tuple(synchronize(ops.grouped_allgather_async(list(tensors), name, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ps = ctx.ps
        reduced = _GroupedAllreduce.apply(Average, None, 1.0, 1.0, ps, *grads)
        rows = synchronize(ops.allgather_async(torch.tensor(ctx.rows, dtype=torch.int64).reshape(1, -1),
                                               None, ps))
        offsets = rows[: ps.rank()].sum(0) if ps.rank() else torch.zeros(len(ctx.rows), dtype=torch.int64)
        return (None, None, *[g.narrow(0, int(o), n)
                              for g, o, n in zip(reduced, offsets.tolist(), ctx.rows, strict=True)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    tensors = list(tensors)  # a generator is read once
    with ops.prechecks("allgather", name, process_set, group=tensors):
        for t in tensors:
            check_tensor("grouped_allgather", t)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                ps: ProcessSet) -> torch.Tensor:
        ctx.root, ctx.ps = root_rank, ps
        return synchronize(ops.broadcast_async(tensor, root_rank, name, ps))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = _Allreduce.apply(grad, Average, None, 1.0, 1.0, ctx.ps)
        if rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A copy of ``tensor`` with the root's value."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)  # type: ignore[no-any-return]


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with the root's value; returns it."""
    return synchronize(ops.broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet) -> Any:
        output, received = synchronize(ops.alltoall_async(tensor, splits, name, ps))
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> Any:
        back, _ = _Alltoall.apply(grad.contiguous(), ctx.received, None, ctx.ps)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows to member i. Returns the rows received, and with
    ``splits`` given also the received splits (as Horovod)."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, ps: ProcessSet,
                pre: float, post: float) -> torch.Tensor:
        ctx.args = (op, ps, pre, post)
        return synchronize(ops.reducescatter_async(tensor, name, op, ps, pre, post))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, ps, pre, post = ctx.args
        grad = _backscale(grad, op, ps, pre, post)
        return _Allgather.apply(grad, None, ps), None, None, None, None, None


def _backscale(grad: torch.Tensor, op: int, ps: ProcessSet, pre: float, post: float) -> torch.Tensor:
    if op == Sum:
        grad = grad * ps.size()
    if pre != 1.0:
        grad = grad * pre
    if post != 1.0:
        grad = grad * post
    return grad


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Compressor = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over the process set and keep this rank's share of dim 0."""
    with ops.prechecks("reducescatter", name, process_set):
        check_tensor("reducescatter", tensor)
        wire, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(wire, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, ps: ProcessSet, pre: float, post: float,
                *tensors: torch.Tensor) -> Any:
        ctx.args = (op, ps, pre, post)
        return tuple(synchronize(ops.grouped_reducescatter_async(list(tensors), name, op, ps, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, ps, pre, post = ctx.args
        scaled = [_backscale(g, op, ps, pre, post) for g in grads]
        return (None, None, None, None, None, *_GroupedAllgather.apply(None, ps, *scaled))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Compressor = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    tensors = list(tensors)  # a generator is read once
    with ops.prechecks("reducescatter", name, process_set, group=tensors):
        for t in tensors:
            check_tensor("grouped_reducescatter", t)
        packed = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                       *[w for w, _ in packed])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed, strict=True)]
