"""The warm-up of the periodic modes: the first ``warmup_steps`` steps average every
synced parameter's gradient over the ranks before the local step, as DDP does.

Post-local SGD (Lin et al. 2018, arXiv 1808.07217) trains synchronously first and only
then locally: the first steps move the parameters the most, and local models that
start apart from a random start average badly (docs/lowcomm.md measures it). torch's
recipe is DDP with ``post_localSGD_hook`` and ``PostLocalSGDState(start_localSGD_iter=W)``
(gradients averaged for the first W iterations) under ``PostLocalSGDOptimizer``;
``warmup_steps=W`` is that warm-up inside ``rt.LocalSGD``/``rt.DiLoCo``, through the same
fused buckets as their syncs. After it every rank holds the same parameters (the same
averaged gradients, the same optimizer) and the local steps start from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ringtrain.errors import ConfigError
from ringtrain.fusion import Bucket, FusedExchange

__all__ = ["average_gradients"]


def average_gradients(mode: str, exchanges: Sequence[FusedExchange], parts: Sequence[Sequence[int]],
                      params: Sequence[torch.nn.Parameter],
                      wait: Callable[[FusedExchange, Bucket], None]) -> None:
    """Average the ``.grad`` of ``params`` over the ranks in place (collective). A missing
    gradient contributes zeros and receives the average when another rank had one; a
    parameter no rank had a gradient for keeps none, as DDP with
    ``find_unused_parameters=True`` (a zero gradient would still move it under momentum
    or Adam). The exchanges must track use (``track_use=True``). Every bucket is launched
    before the first is waited for, through ``wait(exchange, bucket)`` (the mode's: it
    counts the bytes and reports the exchange to the step meter)."""
    for ex, part in zip(exchanges, parts, strict=True):
        for bucket in ex.buckets:
            grads = [params[part[local]].grad for local in bucket.spec.params]
            sparse = next((part[local] for local, g in zip(bucket.spec.params, grads, strict=True)
                           if g is not None and g.is_sparse), None)
            if sparse is not None:
                raise ConfigError(f"rt.{mode}: parameter #{sparse} has a sparse gradient; the warm-up "
                                  "averages dense gradients only (use a dense embedding, or "
                                  "warmup_steps=0)")
            ex.pack(bucket, grads)
            ex.launch(bucket)
    with torch.no_grad():
        for ex, part in zip(exchanges, parts, strict=True):
            for bucket in ex.buckets:
                wait(ex, bucket)
                unused = set(ex.unused(bucket))
                for position, local in enumerate(bucket.spec.params):
                    if position in unused:
                        continue  # no rank had a gradient: it stays None here too
                    p = params[part[local]]
                    # A copy, never the bucket's view: the next step packs over that buffer.
                    averaged = ex.result(bucket, position)
                    if p.grad is None:
                        p.grad = averaged.detach().clone()
                    else:
                        p.grad.copy_(averaged)
