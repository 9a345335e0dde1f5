"""Argument checks of the periodic modes, and the first-step agreement of every rank.

Each rank validates its own arguments when the mode is built (a ``ConfigError`` naming
the argument); what must be equal on every rank (``sync_every``, ``fragments``, the
compression, the strategy, the outer optimizer's settings, the model's tensors) is
compared at the first ``step()``, before anything is exchanged: every rank contributes
its settings to one ``allgather_object`` and applies the same rule to the same table,
so either all raise the same :class:`MismatchError` or none does. A rank whose
``sync_every`` differed would otherwise sync on other steps than the others: its
exchange would pair with theirs and average unrelated parameters, or hang.

:func:`disagreement` is pure and unit-tested.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ringtrain import collectives
from ringtrain.agreement import group_ranks
from ringtrain.errors import ConfigError, MismatchError, ranks_phrase

__all__ = ["Entry", "agree", "check_count", "check_inner", "digest", "disagreement", "optimizer_settings"]

#: (name, shape, dtype) of one synced tensor.
Entry = tuple[str, tuple[int, ...], str]


def check_count(mode: str, name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, else a ConfigError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"rt.{mode}: {name} must be a whole number >= {minimum}, got {value!r}")
    return value


def optimizer_settings(opt: torch.optim.Optimizer) -> str:
    """An optimizer's class and per-group options (not its parameters), as text."""
    groups = [{k: v for k, v in sorted(g.items()) if k != "params"} for g in opt.param_groups]
    return f"{type(opt).__name__}{groups}"


def disagreement(mode: str, entries: Sequence[Sequence[Entry]],
                 settings: Sequence[Mapping[str, str]]) -> str | None:
    """None when every rank's settings and tensors equal rank 0's, else the message
    (the same on every rank: it depends only on the gathered table)."""
    keys = list(dict.fromkeys(k for s in settings for k in s))
    for key in keys:
        values = [s.get(key, "(not set)") for s in settings]
        groups = group_ranks(values)
        if len(groups) > 1:
            listing = "; ".join(f"{values[rs[0]]} on {ranks_phrase(rs)}" for rs in groups)
            return (f"rt.{mode}: {key} differs between ranks: {listing}. Every rank must pass "
                    f"the same {key}: ranks that disagree would sync at different steps or "
                    "average unrelated numbers")
    tables = [[tuple(e) for e in mine] for mine in entries]
    groups = group_ranks(tables, key=tuple)
    if len(groups) > 1:
        ref, other = tables[0], tables[groups[1][0]]
        i = next((i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b),
                 min(len(ref), len(other)))
        a = ref[i] if i < len(ref) else "nothing (its list ends here)"
        b = other[i] if i < len(other) else "nothing (its list ends here)"
        return (f"rt.{mode}: the models differ between ranks: synced tensor #{i} is {a} on "
                f"{ranks_phrase(groups[0])} but {b} on {ranks_phrase(groups[1])}. Every rank must "
                "build the same model (same parameters, shapes, dtypes and order)")
    return None


def agree(mode: str, entries: Sequence[Entry], settings: Mapping[str, str], extra: str = "") -> list[str]:
    """Compare this rank's settings and tensors with every other rank's (collective:
    every rank calls it at its first step); raise MismatchError on every rank. Returns
    every rank's ``extra`` (compared by the caller, e.g. a digest of the parameters)."""
    mine = {"entries": [list(e) for e in entries], "settings": dict(settings), "extra": extra}
    table = collectives.allgather_object(mine, name=f"rt.{mode} settings (first step)")
    message = disagreement(mode, [[(e[0], tuple(e[1]), e[2]) for e in t["entries"]] for t in table],
                           [t["settings"] for t in table])
    if message:
        raise MismatchError(message)
    return [str(t["extra"]) for t in table]


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """A hash of the tensors' bytes (equal on two ranks only if every byte is)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def check_inner(mode: str, optimizer: Any, model_params: Sequence[torch.nn.Parameter],
                argument: str) -> None:
    """The optimizer that steps locally: a torch optimizer over the model's parameters."""
    from ringtrain.optimizer import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        raise ConfigError(
            f"rt.{mode}: {argument} is a DistributedOptimizer, which exchanges gradients after "
            f"every backward; rt.{mode} exchanges every sync_every steps instead. Pass the plain "
            f"torch optimizer (e.g. {type(optimizer.wrapped).__name__}) as {argument}")
    # An rt.LocalSGD / rt.DiLoCo (a torch optimizer too), known by its wrapped optimizer
    # and mode (periodic imports this module: no import of it here).
    if isinstance(getattr(type(optimizer), "mode", None), str) and hasattr(optimizer, "sync_every"):
        raise ConfigError(f"rt.{mode}: {argument} is an rt.{optimizer.mode}, which syncs the model "
                          f"itself; pass the plain torch optimizer it wraps ({argument}.inner)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"rt.{mode}: {argument} must be a torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}")
    ours = {id(p) for p in model_params}
    strangers = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in ours)
    if strangers:
        raise ConfigError(
            f"rt.{mode}: {argument} holds {strangers} parameter(s) that are not the model's; "
            f"build it from the same model's parameters (e.g. {type(optimizer).__name__}"
            "(model.parameters(), ...))")
