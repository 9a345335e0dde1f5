"""Which periodic exchange (``rt.LocalSGD`` / ``rt.DiLoCo``) holds each parameter.

A parameter is exchanged by one mode at a time: a ``DistributedOptimizer`` over it
exchanges its gradient after every backward (its hooks fire whether or not its
``step()`` is called), so combined with a periodic mode the job would pay the per-step
exchange it meant to avoid and average the model twice. The periodic modes record
their parameters here; ``DistributedOptimizer`` refuses a parameter a live one holds,
and the periodic modes refuse one a live ``DistributedOptimizer`` holds
(:func:`ringtrain.optimizer.owner_of`). A newer periodic mode over a parameter takes it
over from an older one (a new training phase), as a newer ``DistributedOptimizer`` does.

Entries are weak on both sides: a mode that is garbage-collected (``del opt``) frees
its parameters. Leaf module: the standard library and torch only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch

__all__ = ["claim", "holder"]

#: id(parameter) -> (weak parameter, weak holder). Keyed by id: a WeakKeyDictionary
#: would compare tensors with ==.
_HELD: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}


def _forget(key: int, _ref: Any) -> None:
    _HELD.pop(key, None)


def holder(param: torch.Tensor) -> Any | None:
    """The live periodic mode holding ``param``, or None."""
    entry = _HELD.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def claim(params: Iterable[torch.Tensor], owner: Any) -> None:
    """Record ``owner`` as the holder of ``params`` (replacing any older holder)."""
    me = weakref.ref(owner)
    for p in params:
        _HELD[id(p)] = (weakref.ref(p, partial(_forget, id(p))), me)
