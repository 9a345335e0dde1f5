"""Learning-rate scaling for data parallelism (Goyal et al. 2017, "ImageNet in 1 Hour").

Linear scaling rule: when the global batch grows k-fold, multiply the learning rate
by k. Gradual warmup: start at the single-worker rate and ramp linearly to the scaled
rate over the first epochs (the paper uses 5), which avoids early divergence.
"""

from __future__ import annotations

import torch

from ringtrain import runtime
from ringtrain.errors import ConfigError

__all__ = ["scale_lr", "warmup", "warmup_factor"]


def _world_size() -> int:
    return runtime.job_world()[1]


def scale_lr(base_lr: float, factor: float | None = None) -> float:
    """``base_lr`` times the number of workers (or ``factor``, e.g. global batch / 256)."""
    if base_lr <= 0:
        raise ConfigError(f"base_lr must be > 0, got {base_lr}")
    return base_lr * (_world_size() if factor is None else factor)


def warmup_factor(step: int, warmup_steps: int, start_factor: float) -> float:
    """The multiplier at ``step``: linear from ``start_factor`` to 1 over ``warmup_steps``."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return start_factor + (1.0 - start_factor) * step / warmup_steps


def warmup(
    optimizer: torch.optim.Optimizer, warmup_steps: int, start_factor: float | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler (call ``.step()`` once per iteration) ramping to the optimizer's rates.

    Set the optimizer's rate to the scaled one (:func:`scale_lr`); the ramp starts at
    ``start_factor`` of it, by default ``1 / size()``, i.e. the single-worker rate.
    """
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    start = 1.0 / _world_size() if start_factor is None else start_factor
    if not 0 < start <= 1:
        raise ConfigError(f"start_factor must be in (0, 1], got {start}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_factor(step, warmup_steps, start)
    )
