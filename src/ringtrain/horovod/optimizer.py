"""``hvd.DistributedOptimizer``: ringtrain's optimizer with Horovod's arguments.

The fusion, the hooks that start each bucket during backward, the Horovod semantics
(summed local passes, ``op=Average`` over the process set, the wrapper being an
instance of the wrapped class sharing its state, ``synchronize``/``skip_synchronize``)
are :class:`ringtrain.DistributedOptimizer`'s. What this module adds:

- the buckets go through the coordinator (:class:`Negotiated`), matched by name, so a
  rank that has ``join()``-ed contributes zeros and a ``process_set`` restricts the
  exchange (a rank outside the set steps on its own gradients, as in Horovod); sparse
  gradients are gathered through it too, so with a joined rank they are refused at once
  (Horovod's rule) instead of waiting for it;
- the names come from the parameters (names, shapes, dtypes), not from how many
  optimizers this process built, so they agree on every rank whatever else a rank wrapped;
- Horovod's argument names and defaults, a fresh optimizer state (Horovod's wrapper is
  a new optimizer over the same ``param_groups``), ``_parameter_names``, ``op=hvd.Adasum``
  (:class:`_AdasumOptimizer`: each rank takes its own step, the steps' deltas are
  combined with Adasum).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ringtrain import collectives
from ringtrain.collectives import Handle, ReduceOp
from ringtrain.errors import ConfigError, OptimizerUsageError
from ringtrain.horovod._coordinator import Meta, ProcessSet, Request
from ringtrain.horovod.basics import engine, global_process_set
from ringtrain.horovod.compression import Compression, Compressor
from ringtrain.horovod.handles import Adasum, Average, Sum, op_name, set_id
from ringtrain.optimizer import DistributedOptimizer as _Core
from ringtrain.optimizer import _eager, _forwarded

__all__ = ["DistributedOptimizer", "Negotiated"]

#: The live Negotiated strategies by the digest of their parameters (see _name_for).
_BY_DIGEST: dict[str, weakref.WeakSet[Negotiated]] = {}


def _digest(pairs: list[tuple[str, torch.Tensor]]) -> str:
    """What names an optimizer's operations in the coordinator: its parameters' names,
    shapes and dtypes, the same on every rank that wraps the same model. A per-process
    count of optimizers named them before, so a rank that had built one more (for an
    evaluation model, say) submitted ``opt1.bucket0`` where the others submitted
    ``opt0.bucket0``, and the step stalled until the stall limit."""
    text = repr([(n, tuple(getattr(p, "shape", ())), str(getattr(p, "dtype", ""))) for n, p in pairs])
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:10]


class Negotiated:
    """An allreduce strategy for the core optimizer that runs through the coordinator."""

    checks_layout = True  # the coordinator compares every bucket by name on every rank

    def __init__(self, process_set: ProcessSet) -> None:
        self.process_set = process_set
        self.digest = ""
        self.slot = 0
        self.prefix = "opt"
        self._owner: Callable[[], _Core | None] = lambda: None

    def bind(self, owner: _Core, digest: str) -> None:
        """Called once the optimizer using this strategy exists, with the digest of its
        parameters (see :func:`_digest` and :meth:`_name_for`)."""
        self._owner = weakref.ref(owner)
        self.digest = digest
        self.prefix = f"opt.{digest}"
        for gone in [d for d, alike in _BY_DIGEST.items() if not alike]:
            del _BY_DIGEST[gone]
        _BY_DIGEST.setdefault(digest, weakref.WeakSet()).add(self)

    def _in_step(self) -> bool:
        owner = self._owner()
        return owner is not None and owner.exchange_started

    def _name_for(self, kind: str, name: str | None) -> str:
        """The coordinator's name of one of this optimizer's operations. Two live
        optimizers over models alike (same names, shapes and dtypes: two copies of one
        model, or unnamed parameters) would share names; the one whose step starts while
        another one's exchange is in flight takes the next free slot. Slots follow the
        order the script uses the optimizers in, the same on every rank, so an optimizer
        that a rank built and never stepped changes no name."""
        if not self._in_step():
            busy = {o.slot for o in _BY_DIGEST.get(self.digest, ()) if o is not self and o._in_step()}
            self.slot = next(k for k in itertools.count() if k not in busy)
            self.prefix = f"opt.{self.digest}" + (f".{self.slot}" if self.slot else "")
        return f"{kind}.{self.prefix}.{name}"

    def group_size(self) -> int:
        # The size the core optimizer averages over (it pre-scales the bucket by 1/size
        # before handing it here). A rank outside the set exchanges nothing and steps on
        # its own gradients, as in Horovod, so for it the "average" is over itself alone:
        # with the set's size its local gradient was divided by it, silently.
        return self.process_set.size() if self.process_set.included() else 1

    def signature(self) -> dict[str, str]:
        return {"strategy": "horovod", "process_set": str(self.process_set.ranks)}

    def __call__(self, tensor: torch.Tensor, op: ReduceOp, name: str | None) -> Handle:
        if not self.process_set.included():
            return Handle(tensor, lambda: None, name)  # not a member: keep the local sum
        sid = set_id(self.process_set)
        meta = Meta(self._name_for("allreduce", name), "allreduce", sid,
                    str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape),
                    op="sum" if op is collectives.Sum else op.value, device=tensor.device.type)
        h = engine().submit(meta, Request(meta, tensor, output=tensor))
        return Handle(tensor, h.wait, name)

    def allgather(self, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Every member's ``tensor`` along dim 0 (the sparse gradients), negotiated like
        the buckets: with a rank that has ``join()``-ed it is refused at once, as in
        Horovod, where a gather on the default group waited for the joined rank."""
        if not self.process_set.included():
            return tensor
        sid = set_id(self.process_set)
        meta = Meta(self._name_for("allgather", name), "allgather", sid,
                    str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape), device=tensor.device.type)
        result: torch.Tensor = engine().submit(meta, Request(meta, tensor)).wait()
        return result


def _named(optimizer: torch.optim.Optimizer, named_parameters: Any) -> list[tuple[str, torch.Tensor]]:
    if named_parameters is not None:
        pairs = list(named_parameters)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters().")
        return pairs
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]


def DistributedOptimizer(  # noqa: N802 - Horovod's name: a factory, as Horovod's is
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Wrap ``optimizer`` so gradients are combined over ``process_set`` (see the module doc)."""
    pairs = _named(optimizer, named_parameters)
    if num_groups or groups is not None:
        warnings.warn("num_groups/groups have no effect here: ringtrain fuses gradients into "
                      "buckets of fusion_mb (RINGTRAIN_FUSION_MB / HOROVOD_FUSION_THRESHOLD)",
                      stacklevel=2)
    # Before choosing Adasum, as Horovod checks it: Adasum has no use for the factor.
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum:
        _check_names(optimizer, pairs)
        return _AdasumOptimizer(optimizer, pairs, compression, backward_passes_per_step, process_set)
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer combines gradients with hvd.Average, hvd.Sum or "
                         f"hvd.Adasum, got {op_name(op)}")
    set_id(process_set)  # registered?
    _check_compression(compression)
    _fresh_state(optimizer)
    strategy = Negotiated(process_set)
    # A rank outside the set exchanges nothing: its gradients stay as backward left them,
    # as in Horovod (no hooks there); compressed, they went through fp16 for nothing
    # (rounded, and inf above 65504).
    wire = compression if process_set.included() else Compression.none
    wrapped = _Core(
        optimizer, named_parameters=pairs, compression=wire,  # type: ignore[arg-type]
        backward_passes_per_step=backward_passes_per_step,
        op=collectives.Average if op == Average else collectives.Sum,
        gradient_predivide_factor=gradient_predivide_factor, strategy=strategy,
        sparse_as_dense=sparse_as_dense,
        # Horovod's semantics: the exchange finishes in step()/synchronize(), so a
        # script may run other backward passes (or other work) before it.
        sync_at="step",
    )
    wrapped.__dict__["_parameter_names"] = {p: n for n, p in pairs}
    strategy.bind(wrapped, _digest(pairs))
    return wrapped


def _check_names(optimizer: torch.optim.Optimizer, pairs: list[tuple[str, torch.Tensor]]) -> None:
    """Horovod's checks, which the core optimizer makes for the other ops: with Adasum a
    parameter missing from ``named_parameters`` was stepped by every rank on its own and
    never combined, so the replicas drifted apart, silently."""
    counts = collections.Counter(n for n, _ in pairs)
    dupes = sorted(n for n, c in counts.items() if c > 1)
    if dupes:
        raise ConfigError(f"named_parameters has duplicate names {dupes[:5]}: every parameter needs "
                         "its own name (pass one model's named_parameters(), or prefix each model's names)")
    named = {id(p) for _, p in pairs}
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in named]
    if missing:
        raise ConfigError(f"{len(missing)} parameter(s) of the optimizer are not in named_parameters; "
                         "pass the same model's named_parameters() the optimizer was built from")


def _check_compression(compression: Any) -> None:
    """The fused exchange applies a compressor as its wire dtype only (one flat buffer per
    bucket, cast once), so a compressor with its own ``compress``/``decompress`` (top-k,
    scaling, Horovod's custom-compressor recipe) was accepted and never called: the
    gradients travelled uncompressed, silently. Such a compressor is refused instead."""
    custom = (isinstance(compression, type)  # Horovod's style: a class of staticmethods
              or (isinstance(compression, Compressor)
                  and (type(compression).compress is not Compressor.compress
                       or type(compression).decompress is not Compressor.decompress)))
    if custom:
        name = getattr(compression, "__name__", type(compression).__name__)
        raise ConfigError(
            f"hvd.DistributedOptimizer(compression={name}): the optimizer's fused exchange "
            "applies only a wire dtype (hvd.Compression.none, .fp16 or .bf16), so this "
            "compressor's own compress()/decompress() would never be called; use one of "
            "those, or op=hvd.Adasum (which calls it), or compress yourself with "
            "hvd.allreduce(tensor, compression=...)")


def _fresh_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's wrapper is a new optimizer over the same ``param_groups`` (so learning
    rates are shared) with an empty ``state``: Adam moments or momentum loaded (or
    broadcast) into the optimizer before wrapping do not carry over, and Horovod's
    examples load and broadcast after wrapping. The same here, said aloud, unless that
    state is all zeros: what ``hvd.broadcast_optimizer_state`` before wrapping leaves (its
    zero-gradient update; Horovod's own pytorch_mnist.py does so), which equals an empty
    state, so dropping it changes nothing."""
    if optimizer.state and not _all_zero(optimizer.state):
        warnings.warn("hvd.DistributedOptimizer starts with an empty optimizer state, as "
                      "Horovod's does: the state this optimizer had (loaded or broadcast "
                      "before wrapping) is not used; load or broadcast it after wrapping",
                      stacklevel=3)
    optimizer.state = collections.defaultdict(dict)


def _all_zero(state: Any) -> bool:
    """Every value in an optimizer's ``state`` (tensors, step counts) is zero."""
    for per_param in state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                if value.numel() and bool(value.detach().ne(0).any()):
                    return False
            elif value not in (0, None):
                return False
    return True


class _AdasumOptimizer:
    """``op=hvd.Adasum``: every rank applies its own update, then the updates (deltas of
    the parameters) are combined with Adasum and applied from the starting point, as
    Horovod's delta optimizer does. Built as a subclass of the wrapped optimizer's class
    sharing its state (see ``__new__``)."""

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any) -> Any:
        base = type(optimizer)
        klass = type(f"DistributedAdasum{base.__name__}", (cls, base), {})
        return object.__new__(klass)

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[str, torch.Tensor]],
                 compression: Compressor, backward_passes_per_step: int, process_set: ProcessSet) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        _fresh_state(optimizer)
        self.__dict__["_inner"] = optimizer
        self.__dict__["_pairs"] = pairs
        self.__dict__["_compression"] = compression
        self.__dict__["_process_set"] = process_set
        self.__dict__["_parameter_names"] = {p: n for n, p in pairs}
        # Adasum's exchange finishes inside step(), so optimizers alike never overlap.
        self.__dict__["_prefix"] = f"adasum.{_digest(pairs)}"
        self.__dict__["backward_passes_per_step"] = backward_passes_per_step

    # Shared state: the wrapped optimizer's own containers, whatever replaces them.
    param_groups = property(lambda self: self._inner.param_groups,
                            lambda self, v: setattr(self._inner, "param_groups", v))
    state = property(lambda self: self._inner.state, lambda self, v: setattr(self._inner, "state", v))
    defaults = property(lambda self: self._inner.defaults,
                        lambda self, v: setattr(self._inner, "defaults", v))
    # What GradScaler.step sets for a fused optimizer's kernel, which reads it from the
    # optimizer that steps (see ringtrain.optimizer.DistributedOptimizer.grad_scale).
    grad_scale = _forwarded("grad_scale")
    found_inf = _forwarded("found_inf")

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Nothing to do before the step: Adasum combines the updates, after it."""

    def skip_synchronize(self) -> Any:
        # Horovod raises here too; without this method the wrapped optimizer's
        # AttributeError ("'SGD' object has no attribute 'skip_synchronize'") was all
        # a script following Horovod's clipping recipe got.
        raise OptimizerUsageError(
            "skip_synchronize() is not supported with op=hvd.Adasum (as in Horovod): Adasum "
            "combines the ranks' updates after step(), not their gradients, so clip the "
            "gradients right before step(), without synchronize()")

    def step(self, closure: Any = None) -> Any:
        params = [p for _, p in self._pairs if p.requires_grad]
        start = [p.detach().clone() for p in params]
        result = self._inner.step(closure) if closure is not None else self._inner.step()
        if self._process_set.included() and self._process_set.size() > 1:
            self._combine(params, start)
        return result

    @_eager  # the exchange's waits and names are not traced; the update above still is
    def _combine(self, params: list[torch.Tensor], start: list[torch.Tensor]) -> None:
        """Replace every rank's own update by the Adasum of the ranks' updates."""
        from ringtrain.horovod.autograd import grouped_allreduce_

        deltas = []
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                deltas.append(p.detach() - s)
        wire = [self._compression.compress(d) for d in deltas]
        grouped_allreduce_([w for w, _ in wire], name=self._prefix, op=Adasum,
                           process_set=self._process_set)
        with torch.no_grad():
            for p, s, (w, ctx) in zip(params, start, wire, strict=True):
                p.copy_(s + self._compression.decompress(w, ctx))
