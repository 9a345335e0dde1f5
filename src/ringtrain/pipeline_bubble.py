"""The pipeline bubble: the idle share of a pipelined schedule (a pure formula shared by
the planner, the doctor's verdict and the pipeline engine, which sit in different layers)."""

from __future__ import annotations

from ringtrain.errors import ConfigError

__all__ = ["bubble_fraction"]


def bubble_fraction(stages: int, microbatches: int) -> float:
    """``(p-1)/(m+p-1)`` for p stages and m micro-batches (GPipe, Huang et al. 2019; 1F1B
    has the same bubble, Narayanan et al. 2019)."""
    if stages < 1 or microbatches < 1:
        raise ConfigError(f"stages and microbatches must be >= 1, got {stages}, {microbatches}")
    return (stages - 1) / (microbatches + stages - 1)
