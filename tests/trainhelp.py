"""The small model and seeded batches that tests comparing a distributed run with one
process on the global batch share (run in the rank processes too)."""

from __future__ import annotations

import torch

__all__ = ["rank_batch", "seeded_batch", "small_regressor", "tiny_model"]


def tiny_model() -> torch.nn.Module:
    """Linear(4, 8), Tanh, Linear(8, 2), the same weights in every process."""
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def seeded_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s ``rows`` rows (inputs x3 so clipping has work), the same everywhere:
    rank r takes rows [r * per_rank, (r + 1) * per_rank)."""
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(rows, 4, generator=g) * 3, torch.randn(rows, 2, generator=g)


def small_regressor() -> torch.nn.Module:
    """Linear(6, 8), Tanh, Linear(8, 1), the same weights in every process (the periodic
    modes' tests: each rank trains its own replica between syncs)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def rank_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s own 4 rows at step ``step`` (different on every rank)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)
