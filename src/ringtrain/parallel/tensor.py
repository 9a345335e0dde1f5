"""Tensor parallelism of linear layers, on DTensor (``torch.distributed.tensor.parallel``).

A plan maps module names (``fnmatch`` patterns over the model's module names, e.g.
``"blocks.*.attn.q"``) to ``"colwise"`` or ``"rowwise"``. Megatron-LM's pairing
(Shoeybi et al. 2019, section 3): the first linear of a pair is split by output
columns, so each rank computes its own slice of the hidden units (its own attention
heads) with no communication; the second is split by input rows and its partial
outputs are summed by one all-reduce. One all-reduce forward and one backward per pair.

A ``"colwise"`` layer's output is each rank's slice of the features, for its rowwise
partner to take. The model's last layer (the head) has no partner: its slice would
reach the loss (a shape error in ``cross_entropy``; a wrong value, silently, in a loss
that broadcasts), so a plan whose last layer is ``"colwise"`` is refused. Split a head
by ``"colwise_gathered"``: its columns are split, and its output is all-gathered whole
onto every tensor rank (``ColwiseParallel(output_layouts=Replicate())``, torchtitan's
output layer without loss parallelism).

Attention splits by heads: a module with ``n_head`` / ``num_heads`` / ``n_heads``
whose projections are in the plan must have a head count the tensor degree divides,
and its forward must take the head count from the (local) tensor shape, as
``q.view(B, T, -1, head_dim)`` does.

:func:`resolve_plan` and :func:`check_plan` are pure checks run on every rank before
any collective, so a layer that does not divide is the same one-line error everywhere.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from ringtrain.errors import ConfigError

__all__ = ["STYLES", "apply_plan", "check_plan", "resolve_plan"]

STYLES: tuple[str, ...] = ("colwise", "rowwise", "colwise_gathered")
_HEAD_ATTRS = ("n_head", "num_heads", "n_heads")


def resolve_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Module name -> style for every module the plan's patterns match."""
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        key = style.strip().lower() if isinstance(style, str) else style
        if key not in STYLES:
            raise ConfigError(
                f"tensor plan {pattern!r}: {style!r} is not one of {', '.join(STYLES)}")
        hits = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ConfigError(
                f"tensor plan pattern {pattern!r} matches no module of the model; check "
                "the names (print(dict(model.named_modules()).keys()))")
        for name in hits:
            out[name] = key
    return out


def check_plan(model: nn.Module, resolved: Mapping[str, str], tensor: int) -> None:
    """A ConfigError naming the first layer that ``tensor`` ranks cannot split evenly."""
    for name, style in resolved.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"tensor plan: {name} is a {type(module).__name__}, only nn.Linear layers "
                "are split; drop it from the plan")
        size, what = ((module.in_features, "input features") if style == "rowwise"
                      else (module.out_features, "output features"))
        if size % tensor:
            fits = [k for k in range(2, size + 1) if size % k == 0][:4]
            raise ConfigError(
                f"tensor parallel: {name} ({style}) has {size} {what}, which tensor="
                f"{tensor} does not divide; choose tensor from {fits or [1]} or resize the layer")
    _check_last_layer(model, resolved)
    _check_not_tied(model, resolved)
    for name, module in model.named_modules():
        heads = next((getattr(module, a) for a in _HEAD_ATTRS
                      if isinstance(getattr(module, a, None), int)), None)
        if heads is None or not any(n.startswith(f"{name}.") for n in resolved):
            continue
        if heads % tensor:
            fits = [k for k in range(2, heads + 1) if heads % k == 0][:4]
            raise ConfigError(
                f"tensor parallel: attention {name or 'model'} has {heads} heads, which "
                f"tensor={tensor} does not divide; choose tensor from {fits or [1]}")


def _check_last_layer(model: nn.Module, resolved: Mapping[str, str]) -> None:
    """A ConfigError when the model's last layer is split by columns alone.

    Its output would be each rank's slice of the features, handed to the loss as if it
    were the whole. The last layer is the last module, in registration order, that
    holds parameters (what ``nn.Sequential`` runs last, and where models register their
    output layer). A pair may be registered in another order than it runs: torchtitan's
    feed-forward registers ``w1``, ``w2``, ``w3`` and splits ``w3`` by columns, ``w2``
    by rows. So a last colwise layer passes when, going back over the layers registered
    before it past other colwise ones, the first is a rowwise layer beside it (same
    parent) that takes its output's width.
    """
    layers = [name for name, module in model.named_modules()
              if next(module.parameters(recurse=False), None) is not None]
    if not layers or resolved.get(layers[-1]) != "colwise":
        return
    last = layers[-1]
    parent, width = last.rpartition(".")[0], model.get_submodule(last).out_features
    for name in reversed(layers[:-1]):
        if resolved.get(name) == "colwise":
            continue
        partner = model.get_submodule(name)
        if (resolved.get(name) == "rowwise" and name.rpartition(".")[0] == parent
                and getattr(partner, "in_features", None) == width):
            return  # its rowwise partner, registered before it
        break
    raise ConfigError(
        f"tensor plan: {last} is the model's last layer and 'colwise' would hand the "
        "loss each tensor rank's slice of its output features; plan it as "
        "'colwise_gathered' (split, output gathered whole) or leave it out of the plan")


def _check_not_tied(model: nn.Module, resolved: Mapping[str, str]) -> None:
    """A ConfigError when a planned layer holds a parameter another module also holds.

    ``parallelize_module`` replaces the layer's parameter by a new DTensor parameter and
    leaves the other holder's tensor whole: an output layer tied to the embedding (GPT-2,
    nanoGPT) would become two parameters, each trained by its own gradients only,
    silently another model than the one process's (its loss drifts from the second step).
    """
    # By module object: one module reused under two names is split once, for both.
    owners: dict[int, list[tuple[int, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append(
                (id(module), f"{mname}.{pname}" if mname else pname))
    for name in resolved:
        layer = model.get_submodule(name)
        for pname, param in layer.named_parameters(recurse=False):
            others = [o for m, o in owners[id(param)] if m != id(layer)]
            if others:
                raise ConfigError(
                    f"tensor plan: {name}.{pname} is tied to {others[0]} (one parameter), "
                    f"and splitting {name} would untie them, each then trained by its own "
                    f"gradients only; leave {name} out of the plan or untie the weights")


def apply_plan(model: nn.Module, resolved: Mapping[str, str], mesh: object) -> None:
    """Split the planned layers over ``mesh`` (a 1-D tensor-parallel DeviceMesh), in place."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    def style_of(style: str) -> ParallelStyle:
        if style == "colwise":
            return ColwiseParallel()
        if style == "colwise_gathered":
            # The output all-gathered along its features; the backward takes each
            # rank's slice of the (identical) gradient, no communication.
            return ColwiseParallel(output_layouts=Replicate())
        return RowwiseParallel()

    styles = {name: style_of(style) for name, style in resolved.items()}
    parallelize_module(model, mesh, styles)  # type: ignore[arg-type]
