"""``rt.DiLoCo``: local steps with an inner optimizer; every ``sync_every``-th step an
outer optimizer steps on the averaged outer gradient (Douillard et al. 2023,
"DiLoCo: Distributed Low-Communication Training of Language Models", arXiv 2311.08105).

At a sync each rank's outer gradient is the synced copy minus its parameters (how far
its ``sync_every`` inner steps moved it); the ranks average it (:mod:`.periodic`), every
rank resets its parameters to the synced copy, and the outer optimizer steps from there
with the average as the gradient. The paper's outer optimizer is SGD with Nesterov
momentum (lr 0.7, momentum 0.9) and its inner one AdamW; with an outer ``SGD(lr=1.0)``
without momentum DiLoCo is local SGD, and with ``sync_every=1`` and an SGD inner
optimizer besides, it is synchronous data parallelism on the global batch.

``fragments=F`` is Streaming DiLoCo's (arXiv 2501.18512) staggered sync: fragment ``f``
syncs at its own phase of each interval (:mod:`.fragments`) and the outer optimizer
steps only that fragment's parameters. The outer optimizer's state (Nesterov momentum)
is the same on every rank: it only ever sees averaged gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain import collectives, replicate, runtime
from ringtrain.compression import Compressor
from ringtrain.errors import ConfigError
from ringtrain.lowcomm import checks
from ringtrain.lowcomm.periodic import PeriodicSync

__all__ = ["DiLoCo"]


class DiLoCo(PeriodicSync):
    """Inner steps with ``inner_optimizer``; outer steps every ``sync_every`` steps.

    Args:
        model: the ``torch.nn.Module`` being trained.
        inner_optimizer: any torch optimizer over the model's parameters (AdamW in the
            paper); it steps locally and its state stays on each rank.
        outer_optimizer: a torch optimizer over the model's parameters
            (``model.parameters()``, or those that require a gradient), e.g.
            ``torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)``.
            Its parameters are the ones synced.
        sync_every: inner steps between outer steps (H >= 1; the paper uses 500).
        compression: ``rt.Compression.none`` (default) / ``.fp16`` / ``.bf16``: the
            outer gradient on the wire.
        fragments: sync in this many parts at staggered steps (Streaming DiLoCo).
        buffers: also average floating-point buffers at each sync of the first fragment.
        warmup_steps: average the gradients over the ranks for this many first steps
            (as DDP), then step locally (post-local SGD's warm-up, torch's
            ``PostLocalSGDState(start_localSGD_iter=...)``); the first sync is
            ``sync_every`` steps after it. Default 0.
        strategy, fusion_mb, **strategy_options: the exchange, as for DistributedOptimizer.
    """

    mode = "DiLoCo"

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer,
        sync_every: int,
        compression: Compressor | None = None,
        fragments: int = 1,
        *,
        buffers: bool = True,
        strategy: str | collectives.AllreduceAlgorithm = "native",
        fusion_mb: float | None = None,
        warmup_steps: int = 0,
        **strategy_options: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"rt.DiLoCo: model must be a torch.nn.Module, got {type(model).__name__}")
        params = list(model.parameters())
        checks.check_inner(self.mode, inner_optimizer, params, "inner_optimizer")
        checks.check_inner(self.mode, outer_optimizer, params, "outer_optimizer")
        if outer_optimizer is inner_optimizer:
            raise ConfigError("rt.DiLoCo: outer_optimizer is inner_optimizer; build a second optimizer "
                              "for the outer steps, e.g. torch.optim.SGD(model.parameters(), lr=0.7, "
                              "momentum=0.9, nesterov=True)")
        outer = [p for g in outer_optimizer.param_groups for p in g["params"]]
        trainable = [p for p in params if p.requires_grad]
        if {id(p) for p in outer} not in ({id(p) for p in params}, {id(p) for p in trainable}):
            raise ConfigError(
                f"rt.DiLoCo: outer_optimizer holds {len(outer)} of the model's {len(params)} parameters "
                f"({len(trainable)} require a gradient); it must hold all of them (model.parameters()) "
                "or those that require a gradient: it steps every parameter that is synced")
        order = {id(p): i for i, p in enumerate(params)}
        synced = sorted(outer, key=lambda p: order[id(p)])
        self._outer = outer_optimizer
        super().__init__(model, inner_optimizer, synced, sync_every=sync_every, fragments_=fragments,
                         compression=compression, strategy=strategy, fusion_mb=fusion_mb, buffers=buffers,
                         argument="inner_optimizer", strategy_options=strategy_options,
                         warmup_steps=warmup_steps)

    @property
    def outer(self) -> torch.optim.Optimizer:
        """The optimizer of the outer steps (schedule its learning rate directly)."""
        return self._outer

    def _settings(self) -> dict[str, str]:
        return {**super()._settings(), "outer_optimizer": checks.optimizer_settings(self._outer)}

    def _apply(self, part: list[int], averaged: dict[int, torch.Tensor], outer: bool = True) -> None:
        assert self._copy is not None
        params = self._params
        saved = [p.grad for p in params]  # the inner step's gradients, given back after
        try:
            stepped = False
            with torch.no_grad():
                for p in params:
                    p.grad = None  # the outer optimizer steps only this fragment
                for i in part:
                    p = params[i]
                    p.copy_(self._copy[i])
                    if outer and p.requires_grad:
                        p.grad = averaged[i].view(p.shape)
                        stepped = True
                    else:
                        # A frozen parameter (or a fragment synced again with no step
                        # since, by sync()) is averaged: the outer optimizer's momentum
                        # would move it as torch's optimizers never move a parameter
                        # without a gradient.
                        p.sub_(averaged[i].view(p.shape))
            if stepped:
                self._outer.step()
        finally:
            for p, g in zip(params, saved, strict=True):
                p.grad = g

    def _state(self) -> dict[str, Any]:
        return {**super()._state(), "outer": self._outer.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        self._outer.load_state_dict(state["outer"])

    def _world_changed_extra(self) -> None:
        if runtime.size() > 1:
            replicate.broadcast_optimizer_state(self._outer, root_rank=0)
