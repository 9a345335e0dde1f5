"""``rt.LocalSGD``: each rank steps alone; every ``sync_every``-th step the ranks average
their parameters (Lin et al. 2018, "Don't use large mini-batches, use local SGD").

The average travels as the outer gradient of :mod:`.periodic` (the synced copy minus
each rank's parameters), so ``rt.Compression.fp16``/``.bf16`` round the change since the
last sync, never the weights themselves; the parameters become the synced copy minus
the averaged change, which is the average of the ranks' parameters. With
``sync_every=1`` this is per-step parameter averaging.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain import collectives
from ringtrain.compression import Compressor
from ringtrain.errors import ConfigError
from ringtrain.lowcomm import checks
from ringtrain.lowcomm.periodic import PeriodicSync

__all__ = ["LocalSGD"]


class LocalSGD(PeriodicSync):
    """Local steps with ``optimizer``; the parameters averaged every ``sync_every`` steps.

    Args:
        model: the ``torch.nn.Module`` being trained (its parameters that require a
            gradient are averaged).
        optimizer: any torch optimizer over the model's parameters; it steps locally and
            its state stays on each rank.
        sync_every: steps between syncs (H >= 1).
        fragments: sync the model in this many parts at staggered steps (each part every
            ``sync_every`` steps), so no step carries the whole model.
        compression: ``rt.Compression.none`` (default) / ``.fp16`` / ``.bf16`` on the wire.
        buffers: also average floating-point buffers (BatchNorm statistics) at each sync
            of the first fragment (default True).
        warmup_steps: average the gradients over the ranks for this many first steps
            (as DDP), then step locally (post-local SGD's warm-up, torch's
            ``PostLocalSGDState(start_localSGD_iter=...)``); the first sync is
            ``sync_every`` steps after it. Default 0.
        strategy, fusion_mb, **strategy_options: the exchange, as for DistributedOptimizer.
    """

    mode = "LocalSGD"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        fragments: int = 1,
        compression: Compressor | None = None,
        buffers: bool = True,
        strategy: str | collectives.AllreduceAlgorithm = "native",
        fusion_mb: float | None = None,
        warmup_steps: int = 0,
        **strategy_options: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"rt.LocalSGD: model must be a torch.nn.Module, got {type(model).__name__}")
        params = list(model.parameters())
        checks.check_inner(self.mode, optimizer, params, "optimizer")
        super().__init__(model, optimizer, [p for p in params if p.requires_grad], sync_every=sync_every,
                         fragments_=fragments, compression=compression, strategy=strategy,
                         fusion_mb=fusion_mb, buffers=buffers, argument="optimizer",
                         strategy_options=strategy_options,
                         warmup_steps=warmup_steps)

    def _apply(self, part: list[int], averaged: dict[int, torch.Tensor], outer: bool = True) -> None:
        assert self._copy is not None
        with torch.no_grad():
            for i in part:
                p = self._params[i]
                p.copy_(self._copy[i]).sub_(averaged[i].view(p.shape))
