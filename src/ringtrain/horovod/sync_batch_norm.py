"""``hvd.SyncBatchNorm``: batch normalisation over the whole job's batch, on CPU and GPU.

In training each rank contributes its element count, sum and sum of squares per channel
(one fused allreduce); every rank normalises with the job-wide mean and (biased)
variance, and the running statistics use the unbiased variance, exactly as
``torch.nn.BatchNorm*d`` on the concatenated batch would. Backward needs two more
job-wide sums per channel (of the normalised input's gradient, and of that times the
normalised input). The weight and bias gradients stay local, as in Horovod and
``torch.nn.SyncBatchNorm``: the optimizer combines them.

Every sum is taken in float64 and a half input (fp16, bf16) is normalised in float32,
as torch's CPU BatchNorm does; a batch of one value per channel over every rank is
torch's ValueError (on every rank), and an empty one leaves the running statistics as
they are. A rank that has ``join()``-ed contributes zeros to the sums, so the others'
statistics are those of their batches alone.

It also serves a ringtrain-native script (``rt.init()`` without ``hvd.init()``): a DDP
script on CPUs, where ``torch.nn.SyncBatchNorm`` refuses CPU tensors, converts its model
with :meth:`SyncBatchNorm.convert_sync_batchnorm` and trains with
``rt.DistributedOptimizer``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ringtrain import collectives, runtime
from ringtrain.horovod import basics, ops
from ringtrain.horovod.handles import Sum, synchronize

__all__ = ["SyncBatchNorm"]


def _sum_over_ranks(t: torch.Tensor, what: str) -> torch.Tensor:
    if basics.is_initialized():
        return synchronize(ops.allreduce_async(t, op=Sum))  # type: ignore[no-any-return]
    if runtime.is_initialized():
        # A ringtrain-native script (rt.init(), rt.DistributedOptimizer) porting DDP's
        # SyncBatchNorm to the CPU, where torch's refuses CPU tensors: the job's own
        # allreduce (it failed on an unregistered process set, pointing at hvd.init()).
        return collectives.allreduce(t, op=collectives.Sum, name=f"SyncBatchNorm {what}")
    basics.engine()  # Horovod's ValueError: "Horovod has not been initialized; use hvd.init()."
    raise AssertionError("unreachable")


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (N * prod(*), C)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t()


def _shape(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (x.dim() - 2))


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a half input is normalised in (float32, as torch's CPU BatchNorm does)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, stats_out: list[torch.Tensor]) -> torch.Tensor:
        # Sums in float64: E[x^2] - E[x]^2 loses the variance of data far from zero in
        # float32, and a half dtype's sum overflows past 65504.
        flat = _channels_last(x)
        local = torch.cat([torch.tensor([flat.shape[0]], dtype=torch.float64, device=x.device),
                           flat.sum(0, dtype=torch.float64), flat.double().square().sum(0)])
        total = _sum_over_ranks(local, "statistics")
        c = x.shape[1]
        count = float(total[0])
        if count == 1:
            # torch.nn.BatchNorm's and torch.nn.SyncBatchNorm's error: one value per
            # channel has no variance (its output was 0, and the unbiased running
            # variance shrank towards 0). Every rank sees the same count, so every rank
            # raises it.
            raise ValueError("Expected more than 1 value per channel when training, got 1 over every "
                             f"rank's batch (this rank's input size {tuple(x.shape)})")
        mean64 = total[1:1 + c] / max(count, 1.0)
        var64 = (total[1 + c:] / max(count, 1.0) - mean64 * mean64).clamp_min(0)
        acc = _math_dtype(x.dtype)
        mean, invstd = mean64.to(acc), torch.rsqrt(var64 + eps).to(acc)
        y = (x.to(acc) - _shape(mean, x)) * _shape(invstd, x)
        if weight is not None:
            y = y * _shape(weight, x)
        if bias is not None:
            y = y + _shape(bias, x)
        # The input's dtype, as torch's BatchNorm and Horovod's keep it (fp32 weights, under
        # autocast or a half input into an fp32 model, promoted a half input's output).
        y = y.to(x.dtype)
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.count = count
        stats_out.extend([mean64, var64, total[0]])
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        # Once differentiable: a gradient of this gradient (a gradient penalty) would take
        # the job-wide sums and the statistics as constants, a wrong number; torch's error
        # instead, as Horovod's (its backward kernel has no derivative).
        x, mean, invstd, weight = ctx.saved_tensors
        acc = mean.dtype
        xhat = (x.to(acc) - _shape(mean, x)) * _shape(invstd, x)
        dy_acc = dy.to(acc)
        dxhat = dy_acc * _shape(weight, dy).to(acc) if weight is not None else dy_acc
        c = dy.shape[1]
        # The sums in float64 too: over a large half batch they overflowed to inf, and
        # every input gradient came back NaN.
        local = torch.cat([_channels_last(dxhat).sum(0, dtype=torch.float64),
                           _channels_last(dxhat * xhat).sum(0, dtype=torch.float64)])
        total = (_sum_over_ranks(local, "gradient sums") / max(ctx.count, 1.0)).to(acc)
        mean_dxhat, mean_dxhat_xhat = total[:c], total[c:]
        dx = ((dxhat - _shape(mean_dxhat, dy) - xhat * _shape(mean_dxhat_xhat, dy)) * _shape(invstd, dy)).to(dy.dtype)
        dw = (_channels_last(dy_acc * xhat).sum(0, dtype=torch.float64).to(weight.dtype)
              if weight is not None else None)
        db = _channels_last(dy).sum(0, dtype=torch.float64).to(acc) if ctx.needs_input_grad[2] else None
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
            n = float(count)
            if n == 0:
                # An empty batch on every rank: torch's BatchNorm leaves the running
                # statistics as they are (the mean of no values, NaN, replaced them).
                return out  # type: ignore[no-any-return]
            momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                        else self.momentum)
            unbiased = var * (n / (n - 1.0))
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype) * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype) * momentum)
        return out  # type: ignore[no-any-return]

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
        """Every ``BatchNorm*d`` in ``module`` replaced by this class, as
        ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does (Horovod has none): a
        DDP script's conversion, whose torch ``SyncBatchNorm`` refuses CPU tensors. The
        new layers share the old ones' weight, bias and running statistics."""
        if process_group is not None:
            raise ValueError("hvd.SyncBatchNorm synchronises over the whole job: convert_sync_batchnorm "
                             "takes no process_group; leave it out")
        out = module
        if isinstance(module, _BatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
            if module.affine:
                out.weight, out.bias = module.weight, module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out
