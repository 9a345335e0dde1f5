"""Cut a model into pipeline stages: by module name or by an even parameter count.

A model can be pipelined when its forward is its *units* applied in order, each to
the previous one's output. The units are the model's top-level children, with an
``nn.ModuleList`` or ``nn.Sequential`` child opened one level (so ``blocks.0``,
``blocks.1``, ... are units of their own); an ``nn.Sequential`` model's units are its
children. A GPT written as ``embed -> blocks[0..L) -> head`` is such a model. The
stages run the units, never the model's forward; :mod:`ringtrain.parallel.order`
checks at the first pipelined step that the forward does the same.

A stage is a contiguous run of units. :class:`StageModule` holds them under their
original names, so a stage's ``state_dict`` keys are exactly the full model's keys for
those units: checkpoints saved by one split load into another, or into the whole
model on one process.

The cut itself (:func:`split_by_params`, :func:`split_by_names`) is a pure function
of the units' parameter counts and names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ringtrain.errors import ConfigError

__all__ = ["StageModule", "pipeline_units", "split_by_names", "split_by_params", "split_units"]


def pipeline_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's units in forward order (see the module docstring)."""
    children = list(model.named_children())
    if isinstance(model, nn.Sequential):
        return children
    units: list[tuple[str, nn.Module]] = []
    for name, child in children:
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units.extend((f"{name}.{i}", sub) for i, sub in child.named_children())
        else:
            units.append((name, child))
    return units


def split_by_params(counts: Sequence[int], stages: int) -> list[int]:
    """Start index of each stage so that stages hold parameter counts as even as possible.

    Contiguous partition of ``counts`` into ``stages`` non-empty runs minimising the
    largest run (the pipeline runs at the pace of its heaviest stage); ties go to the
    earliest cut. Exact dynamic programming, O(stages * n^2) for n units.
    """
    n = len(counts)
    if stages < 1:
        raise ConfigError(f"stages must be >= 1, got {stages}")
    if stages > n:
        raise ConfigError(
            f"{stages} pipeline stages but the model has only {n} unit(s) to place; "
            f"use pipeline <= {n} (or split the model into more modules)")
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible heaviest stage placing units [0, i) in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts: list[int] = []
    i = n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_by_names(names: Sequence[str], first_of_stage: Sequence[str], stages: int) -> list[int]:
    """Start index of each stage from the names of the units that begin stages 1, 2, ..."""
    if len(first_of_stage) != stages - 1:
        raise ConfigError(
            f"{stages} pipeline stages need {stages - 1} split point(s) (the first unit of "
            f"every stage after the first), got {len(first_of_stage)}: {list(first_of_stage)}")
    index = {name: i for i, name in enumerate(names)}
    starts = [0]
    for name in first_of_stage:
        if name not in index:
            raise ConfigError(
                f"split point {name!r} is not a pipeline unit of this model; units are: "
                f"{', '.join(names)}")
        if index[name] <= starts[-1]:
            raise ConfigError(
                f"split point {name!r} does not come after the previous stage's first unit "
                f"{names[starts[-1]]!r}; list split points in forward order, each starting "
                "a non-empty stage")
        starts.append(index[name])
    return starts


def split_units(model: nn.Module, stages: int,
                split: str | Sequence[str] = "params") -> list[list[tuple[str, nn.Module]]]:
    """The units of each stage; ``split`` is ``"params"`` or the split-point names."""
    units = pipeline_units(model)
    names = [name for name, _ in units]
    _check_all_state_in_units(model, units)
    if stages > len(units):
        raise ConfigError(
            f"{stages} pipeline stages but the model has only {len(units)} unit(s) "
            f"({', '.join(names)}); use pipeline <= {len(units)}")
    if isinstance(split, str):
        if split != "params":
            raise ConfigError(
                f"split={split!r}: give 'params' (even parameter count) or a list of the "
                "unit names that start stages 1, 2, ...")
        counts = [sum(p.numel() for p in m.parameters()) for _, m in units]
        starts = split_by_params(counts, stages)
    else:
        starts = split_by_names(names, list(split), stages)
    bounds = [*starts, len(units)]
    groups = [units[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    _check_no_shared_parameters(groups)
    return groups


def _check_all_state_in_units(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> None:
    # A stage runs only its units: a parameter or buffer held by the model itself (or by
    # an opened ModuleList / Sequential) is in no stage, so the pipeline would silently
    # compute without it (and never train or save it).
    held = {id(t) for _, unit in units for t in (*unit.parameters(), *unit.buffers())}
    for kind, named in (("parameter", model.named_parameters()),
                        ("buffer", model.named_buffers())):
        for name, tensor in named:
            if id(tensor) not in held:
                raise ConfigError(
                    f"{kind} {name} belongs to no pipeline unit (units: "
                    f"{', '.join(n for n, _ in units)}); a pipeline runs only the units, in "
                    "order, so move it into one of them (e.g. a small module that applies it)")


def _check_no_shared_parameters(groups: Sequence[Sequence[tuple[str, nn.Module]]]) -> None:
    # A parameter shared by two stages (e.g. an embedding tied to the output layer)
    # would live on two ranks and get two different gradients.
    owner: dict[int, tuple[int, str]] = {}
    for stage, units in enumerate(groups):
        for name, module in units:
            for pname, p in module.named_parameters():
                seen = owner.setdefault(id(p), (stage, f"{name}.{pname}"))
                if seen[0] != stage:
                    raise ConfigError(
                        f"parameter {seen[1]} (stage {seen[0]}) is the same tensor as "
                        f"{name}.{pname} (stage {stage}); untie them or move the split so "
                        "both sit in one stage")


class StageModule(nn.Module):
    """A run of units under their original names, applied in order."""

    def __init__(self, units: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.unit_names: list[str] = []
        for name, module in units:
            head, _, tail = name.partition(".")
            if tail:
                holder = self._modules.get(head)
                if holder is None:
                    holder = nn.ModuleDict()
                    self.add_module(head, holder)
                if not isinstance(holder, nn.ModuleDict):
                    raise ConfigError(f"unit {name!r} clashes with unit {head!r}")
                holder[tail] = module
            else:
                self.add_module(name, module)
            self.unit_names.append(name)

    def unit(self, name: str) -> nn.Module:
        return self.get_submodule(name)

    def units(self) -> list[tuple[str, nn.Module]]:
        return [(name, self.get_submodule(name)) for name in self.unit_names]

    def forward(self, x: Any) -> Any:
        for name in self.unit_names:
            x = self.get_submodule(name)(x)
        return x
