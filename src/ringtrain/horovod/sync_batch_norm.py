"""``hvd.SyncBatchNorm``: batch normalisation over the whole job's batch, on CPU and GPU.

In training each rank contributes its element count, sum and sum of squares per channel
(one fused allreduce); every rank normalises with the job-wide mean and (biased)
variance, and the running statistics use the unbiased variance, exactly as
``torch.nn.BatchNorm*d`` on the concatenated batch would. Backward needs two more
job-wide sums per channel (of the normalised input's gradient, and of that times the
normalised input). The weight and bias gradients stay local, as in Horovod and
``torch.nn.SyncBatchNorm``: the optimizer combines them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ringtrain.horovod import ops
from ringtrain.horovod.handles import Sum, synchronize

__all__ = ["SyncBatchNorm"]


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    return synchronize(ops.allreduce_async(t, op=Sum))  # type: ignore[no-any-return]


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (N * prod(*), C)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t()


def _shape(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (x.dim() - 2))


class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, stats_out: list[torch.Tensor]) -> torch.Tensor:
        flat = _channels_last(x).double()
        local = torch.cat([torch.tensor([flat.shape[0]], dtype=torch.float64, device=x.device),
                           flat.sum(0), (flat * flat).sum(0)])
        total = _sum_over_ranks(local)
        c = x.shape[1]
        count = total[0]
        mean = total[1:1 + c] / count
        var = total[1 + c:] / count - mean * mean
        invstd = torch.rsqrt(var + eps)
        xhat = (x - _shape(mean, x).to(x.dtype)) * _shape(invstd, x).to(x.dtype)
        y = xhat
        if weight is not None:
            y = y * _shape(weight, x)
        if bias is not None:
            y = y + _shape(bias, x)
        # fp32 weights (autocast, or a half input into an fp32 model) promoted a half
        # input's output to fp32; torch's BatchNorm and Horovod's keep the input's dtype.
        y = y.to(x.dtype)
        ctx.save_for_backward(xhat, invstd.to(x.dtype), weight)
        ctx.count = float(count)
        stats_out.extend([mean.to(x.dtype), var.to(x.dtype), count])
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        dxhat = dy * _shape(weight, dy) if weight is not None else dy
        c = dy.shape[1]
        local = torch.cat([_channels_last(dxhat).sum(0), _channels_last(dxhat * xhat).sum(0)]).double()
        total = _sum_over_ranks(local).to(dy.dtype)
        mean_dxhat, mean_dxhat_xhat = total[:c] / ctx.count, total[c:] / ctx.count
        dx = (dxhat - _shape(mean_dxhat, dy) - xhat * _shape(mean_dxhat_xhat, dy)) * _shape(invstd, dy)
        dw = _channels_last(dy * xhat).sum(0) if weight is not None else None
        db = _channels_last(dy).sum(0) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch norm whose statistics span every rank's batch (any input of shape (N, C, *))."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return super().forward(input)
        stats: list[torch.Tensor] = []
        out = _SyncBN.apply(input, self.weight, self.bias, self.eps, stats)
        if self.training and self.track_running_stats and self.running_mean is not None:
            mean, var, count = stats
            assert self.num_batches_tracked is not None and self.running_var is not None
            self.num_batches_tracked.add_(1)
            momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                        else self.momentum)
            n = float(count)
            unbiased = var * (n / max(n - 1.0, 1.0))
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach() * momentum)
        return out  # type: ignore[no-any-return]
