"""Check that a model's forward runs its pipeline units as the stages will.

A pipeline never calls the model's own ``forward``: each stage applies its units in
registration order, each to the previous one's output alone (:class:`StageModule`).
A model whose forward runs the units in another order, skips or reuses one, passes a
unit more than the previous output, or computes between units (``torch.tanh(...)``
around a unit, a residual across units) would be trained as another network without
any error: the loss still falls, only not the model's.

So the first pipelined step runs the model's own forward once on the ``meta`` device
(shapes only: no memory, no arithmetic), on a copy whose parameters are meta tensors,
and watches the units with forward hooks: unit ``i`` must be the ``i``-th call, get
exactly the previous unit's output object (the model's input for the first), and the
model must return the last unit's output object. Identity, not equality, so any
computation in between is seen. A forward that cannot run on ``meta`` (an operation
without a meta kernel, a branch on a value) is not checked, with a warning.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ringtrain.errors import ConfigError

__all__ = ["OrderProbe", "split_order_problem", "order_probe"]

log = logging.getLogger("ringtrain.parallel")


def order_probe(model: nn.Module, names: Sequence[str],
                plan: Mapping[str, str] | None = None) -> OrderProbe | None:
    """A probe of ``model``'s forward over the units ``names``, or None (not copyable).

    ``plan``: the tensor plan (module name -> style) whose split layers' call order the
    probe also checks (see :func:`split_order_problem`).

    Call before the model is cut: the copy shares no storage with it (every parameter
    and buffer is replaced by a meta tensor of its shape), so it costs no memory.
    """
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = (nn.Parameter(meta, requires_grad=t.requires_grad)
                           if isinstance(t, nn.Parameter) else meta)
    try:
        skeleton = copy.deepcopy(model, memo)
    except Exception as exc:  # a module holding something that cannot be copied
        log.warning("cannot check that the model's forward runs its pipeline units in "
                    "order (the model cannot be copied: %s)", exc)
        return None
    return OrderProbe(skeleton, names, plan or {})


def split_order_problem(calls: Sequence[str], plan: Mapping[str, str], complete: bool = True) -> str | None:
    """The error for split layers called in the order ``calls``, or None. ``complete``:
    ``calls`` is the whole forward's (False while it runs: the pairs are checked as each
    layer is called, before DTensor fails inside a misplanned one, but not the last call).

    A ``"colwise"`` layer's output is each tensor rank's slice of its features, which
    only a ``"rowwise"`` layer takes (Megatron's pairing: q, k, v then o; w1, w3 then
    w2). So a ``"colwise"`` layer called after every other split layer hands the loss
    the slice (the registration-order check in :mod:`ringtrain.parallel.tensor` misses
    a head registered before a final norm), and a ``"rowwise"`` layer whose input did
    not come from a ``"colwise"`` one, or a ``"colwise_gathered"`` one called on a
    slice, would fail deep in DTensor with a multi-line sharding error.
    """
    if not calls:
        return None
    if complete and plan.get(calls[-1]) == "colwise":
        return (f"tensor plan: {calls[-1]} ('colwise') is the last split layer the model's "
                "forward calls, so the loss would get each tensor rank's slice of its output "
                "features; plan it as 'colwise_gathered' (split, output gathered whole) or "
                "leave it out of the plan")
    previous = None
    for name in calls:
        style = plan.get(name)
        if style == "rowwise" and plan.get(previous or "") != "colwise":
            after = f"after {previous} ({plan.get(previous or '')!r})" if previous else "first"
            return (f"tensor plan: {name} ('rowwise') is called {after}, so its input is not the "
                    "slice a 'colwise' layer makes; pair each 'rowwise' layer with the 'colwise' "
                    "layer(s) the forward calls just before it (e.g. q, k, v then o), or leave it "
                    "out of the plan")
        if style == "colwise_gathered" and plan.get(previous or "") == "colwise":
            return (f"tensor plan: {name} ('colwise_gathered') is called after {previous} "
                    "('colwise'), whose output is each rank's slice; a 'colwise' layer's output "
                    "goes to a 'rowwise' layer: plan the layer after it as 'rowwise'")
        previous = name
    return None


class OrderProbe:
    """The model's forward, on meta tensors, compared with the stages' order."""

    def __init__(self, skeleton: nn.Module, names: Sequence[str],
                 plan: Mapping[str, str] | None = None) -> None:
        self.skeleton = skeleton
        self.names = list(names)
        self.plan = dict(plan or {})

    def check(self, shape: Sequence[int], dtype: torch.dtype, stages: int) -> None:
        """A ConfigError unless forward on an input of ``shape`` runs the units in order."""
        units = [self.skeleton.get_submodule(name) for name in self.names]
        calls: list[tuple[int, tuple[Any, ...], dict[str, Any], Any]] = []

        def hook(i: int) -> Any:
            def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       output: Any) -> None:
                calls.append((i, args, kwargs, output))
            return record

        handles = [unit.register_forward_hook(hook(i), with_kwargs=True)
                   for i, unit in enumerate(units)]
        split: list[str] = []  # the planned layers, in the order forward calls them
        handles += [self.skeleton.get_submodule(name).register_forward_hook(
            lambda *_, name=name: split.append(name)) for name in self.plan]
        x = torch.empty(list(shape), dtype=dtype, device="meta")
        try:
            with torch.no_grad():
                out = self.skeleton(x)
        except Exception as exc:
            log.warning("cannot check that the model's forward runs its pipeline units in "
                        "order (it does not run on the meta device: %s: %s); a forward that "
                        "does anything else than apply them in order trains another model",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return
        finally:
            for handle in handles:
                handle.remove()
        problem = self._problem(calls, x, out)
        if problem is None:
            head = split_order_problem(split, self.plan)
            if head is not None:
                raise ConfigError(head)
            return
        shown = ", ".join(self.names[:5]) + (", ..." if len(self.names) > 5 else "")
        raise ConfigError(
            f"pipeline={stages}: the model's forward {problem}, but a pipeline stage runs "
            f"the units ({shown}) in registration order, each once on the previous one's "
            "output alone, so it would train another model; register the units in the "
            "order forward calls them and move any computation between them into a unit "
            "(or train without a pipeline)")

    def _problem(self, calls: Sequence[tuple[int, tuple[Any, ...], dict[str, Any], Any]],
                 x: torch.Tensor, out: Any) -> str | None:
        names = self.names
        previous: Any = x
        for at, (i, args, kwargs, output) in enumerate(calls):
            if i < at:
                return f"calls {names[i]} again after {names[calls[at - 1][0]]}"
            if i > at:
                return (f"calls {names[i]} where {names[at]} comes next" if at == 0 else
                        f"calls {names[i]} after {names[calls[at - 1][0]]}, where "
                        f"{names[at]} comes next")
            if kwargs or len(args) != 1 or args[0] is not previous:
                given = "the model's input" if at == 0 else f"the output of {names[at - 1]}"
                return f"does not call {names[i]} with {given} alone"
            previous = output
        if len(calls) < len(names):
            return f"never calls {names[len(calls)]}"
        if out is not previous:
            return f"does not return the output of {names[-1]} as it is"
        return None
