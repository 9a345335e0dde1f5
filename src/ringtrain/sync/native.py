"""native: the backend's own allreduce (NCCL's ring/tree on GPUs, Gloo's on CPUs).

The default strategy. It is the same call as ``rt.allreduce(..., algorithm="native")``;
as a strategy it also records arrivals and waits with ``stall_timeout``, so a missing
rank is named instead of the job hanging.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ringtrain import collectives, inflight, runtime
from ringtrain.collectives import Handle, ReduceOp, finish_average, torch_op
from ringtrain.sync import stall
from ringtrain.sync.base import Strategy

__all__ = ["Native"]


class Native(Strategy):
    """The backend's allreduce on the default process group."""

    name = "native"

    def __call__(self, tensor: torch.Tensor, op: ReduceOp, name: str | None) -> Handle:
        reduce_op = torch_op(op)
        size = runtime.size()
        arrival = stall.tracker().arrive(name, tensor)
        timeout = self.timeout()
        started = time.monotonic()
        # The result is written outside autograd, as torch's dist.all_reduce writes it: a
        # parameter reduced in place was left holding the *sum* (the backend had written
        # it) when the division by size() raised for a leaf that requires grad.
        # Only then: a detached alias is a second tensor on the storage, and
        # inflight.hold keeps it past the exchange, so fusion's reference count
        # (_held_elsewhere) would take it for a kept gradient and pack every step
        # into a new buffer.
        out = tensor.detach() if tensor.requires_grad else tensor
        # The same staging as rt.allreduce: under NCCL a CPU tensor travels via the GPU.
        comm = collectives.staged(out)
        inflight.hold(comm)  # released only once Gloo's worker let go (see ringtrain.inflight)
        try:
            work = dist.all_reduce(comm, op=reduce_op, async_op=True)
        except RuntimeError as exc:
            raise stall.failure(arrival, exc, started, timeout) from None

        def wait() -> None:
            stall.wait_work(work, arrival, timeout)
            if comm is not out:
                out.copy_(comm)
            finish_average(out, op, size)

        return Handle(tensor, wait, name)
