"""Adasum: combine gradients so that parallel directions are averaged and orthogonal
ones added (Maleki et al., "Scaling Distributed Training with Adaptive Summation",
MLSys 2021; Horovod's ``op=hvd.Adasum``).

For two vectors ``a`` and ``b``::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

Identical vectors give ``a`` (their mean), orthogonal ones ``a + b`` (their sum). Ranks
are combined in a binary tree in rank order, ((r0, r1), (r2, r3)), ... as Horovod's
recursive doubling pairs them; with a count that is not a power of two the last one
is carried up a level. Dot products and norms are taken in float64; a zero vector
contributes nothing and leaves the other unchanged. Pure functions, shared by the
coordinator (allreduce with Adasum) and its tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["adasum_pair", "adasum_tree"]


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot = float(torch.dot(a64, b64))
    na, nb = float(torch.dot(a64, a64)), float(torch.dot(b64, b64))
    ca = 1.0 - dot / (2.0 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2.0 * nb) if nb > 0 else 1.0
    return (ca * a64 + cb * b64).reshape(a.shape).to(a.dtype)


def adasum_tree(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum of the tensors of every rank, in rank order."""
    if not tensors:
        raise ValueError("adasum of no tensors")
    level = list(tensors)
    while len(level) > 1:
        nxt = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].clone()
