"""Small pieces the model-parallel tests share: a token batch drawn from a step's seed,
and the language-model loss over it."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["token_batch", "token_loss"]


def token_batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of step ``step``: the same on every rank and in every run."""
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, vocab, (batch, seq), generator=g),
            torch.randint(0, vocab, (batch, seq), generator=g))


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of logits ``(..., vocab)`` against token targets."""
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
