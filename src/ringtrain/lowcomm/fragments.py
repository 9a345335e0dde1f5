"""Fragments of a model and when each one syncs: pure functions, the same on every rank.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) syncs the model in ``F``
fragments at staggered steps, so no single step carries the whole model: with
``sync_every=H`` fragment ``f`` syncs at the steps ``s`` with ``s % H == o_f``, where the
offsets ``o_f = ((f + 1) * H // F) % H`` spread the fragments evenly over the interval
(``F = 1``: every ``H``-th step; ``H = 50, F = 2``: fragment 0 at 25, 75, ...,
fragment 1 at 50, 100, ...). Each fragment still syncs every ``H`` steps; only its
phase differs, and its first interval is shorter.

Fragments are runs of consecutive parameters (in the model's order, as the paper cuts
a transformer into groups of consecutive blocks), cut so their sizes are as even as the
parameters allow.
"""

from __future__ import annotations

from collections.abc import Sequence

from ringtrain.errors import ConfigError

__all__ = ["due", "offsets", "split"]


def split(numels: Sequence[int], fragments: int) -> list[list[int]]:
    """Indices of ``numels`` in ``fragments`` consecutive, non-empty runs of about equal
    total size: each cut is placed where the running total is closest to ``k/F`` of it."""
    n = len(numels)
    if not 1 <= fragments <= max(n, 1):
        raise ConfigError(f"fragments={fragments} must be between 1 and the number of "
                          f"parameter tensors ({n})")
    total = sum(numels)
    prefix = [0]
    for x in numels:
        prefix.append(prefix[-1] + x)
    cuts: list[int] = []
    for k in range(1, fragments):
        # A cut after `c` tensors; each side keeps at least one tensor per fragment.
        lo, hi = (cuts[-1] if cuts else 0) + 1, n - (fragments - k)
        target = total * k / fragments
        gaps = {c: abs(prefix[c] - target) for c in range(lo, hi + 1)}
        cuts.append(min(gaps, key=lambda c: (gaps[c], c)))
    bounds = [0, *cuts, n]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(fragments)]


def offsets(sync_every: int, fragments: int) -> list[int]:
    """The step remainder (mod ``sync_every``) at which each fragment syncs."""
    return [((f + 1) * sync_every // fragments) % sync_every for f in range(fragments)]


def due(step: int, sync_every: int, fragments: int) -> list[int]:
    """The fragments that sync after the ``step``-th step (counted from 1)."""
    if step < 1:
        return []
    r = step % sync_every
    return [f for f, o in enumerate(offsets(sync_every, fragments)) if o == r]
