"""DistributedOptimizer: wrap any torch optimizer so gradients are combined across ranks.

Semantics are Horovod's (``horovod.torch.DistributedOptimizer``), so scripts written
for it train the same:

- ``backward_passes_per_step=k``: the k local passes are *summed* (autograd accumulates
  into ``.grad``), then combined across ranks; ``op=Average`` divides by ``size()``
  only. A script that wants the mean over passes divides its loss by k.
- The wrapper is an instance of the wrapped optimizer's own class (``isinstance(opt,
  torch.optim.SGD)`` holds) and has no state of its own: ``param_groups``, ``state``
  and ``defaults`` *are* the wrapped optimizer's, whatever replaces them later
  (``load_state_dict``, ``broadcast_optimizer_state``), so a learning rate set through
  either object reaches the update on every rank.

How a step flows:

1. ``backward()`` accumulates a parameter's gradient, then its post-accumulate hook
   counts the pass. On the ``backward_passes_per_step``-th pass the parameter is ready.
2. When every parameter of a fusion bucket is ready, :mod:`ringtrain.fusion` packs the
   bucket and its asynchronous exchange starts while backward goes on. Without
   compression each ``.grad`` becomes a view of the bucket (as DDP's
   ``gradient_as_bucket_view``). Buckets start in plan order on every rank, so ranks
   issue the same sequence.
3. ``sync_at="backward"`` (the default): when the backward that completes the step
   (the ``backward_passes_per_step``-th) ends, the buckets still pending start
   (parameters that got no gradient contribute zeros) and backward returns once all
   are in, as under DDP: ``.grad`` then holds the combined gradient, so clipping,
   ``GradScaler.unscale_`` or a collective between ``backward()`` and ``step()`` see
   the same gradients on every rank. ``sync_at="step"`` (Horovod's, and
   ``ringtrain.horovod``'s): that happens in ``step()`` or ``synchronize()``, and
   gradients must be read only after ``synchronize()``.
4. ``step()`` runs the wrapped optimizer on the combined gradients. ``zero_grad()``
   after the exchange and before ``step()`` drops the step (a skipped update, as
   GradScaler does on an overflow); during an accumulation it is an error.

Sparse gradients (``nn.Embedding(sparse=True)``) are exchanged as Horovod does: the
indices and values of every rank are gathered and summed (``sparse_as_dense=True``
densifies them into the fused buckets instead). Which parameters are sparse is agreed
by all ranks at the first step; a parameter whose first sparse gradient comes later is
exchanged densely (its result is still correct). Under ``ringtrain.horovod`` the gathers
go through the coordinator, which refuses them at once while a rank has ``join()``-ed,
as Horovod does (a gather has nothing for a joined rank to contribute):
``sparse_as_dense=True`` is the way to train sparse gradients with ``join()``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch

from ringtrain import claims, collectives, events, runtime, sync
from ringtrain.collectives import Average, Max, ReduceOp, Sum
from ringtrain.compression import Compression, Compressor
from ringtrain.errors import ConfigError, OptimizerUsageError
from ringtrain.fusion import Bucket, FusedExchange

__all__ = ["DistributedOptimizer", "owner_of"]

#: For the exchange's bookkeeping (locks, waits, clocks): a script that compiles its whole
#: step breaks its graph there and runs it as written, while the wrapped optimizer's
#: update is still traced. torch marks its optimizers' ``zero_grad`` the same way; the
#: compiler is imported at the first call, as torch's first ``zero_grad`` imports it.
log = logging.getLogger("ringtrain")

_eager = torch._disable_dynamo

_CLASSES: dict[type, type] = {}


def _forwarded(name: str) -> property:
    """An attribute of the wrapped optimizer, read, set and deleted through the wrapper
    (reading one it lacks raises AttributeError, so ``getattr(opt, name, None)`` works)."""

    def get(self: Any) -> Any:
        return getattr(self._inner, name)

    def set_(self: Any, value: Any) -> None:
        setattr(self._inner, name, value)

    def delete(self: Any) -> None:
        delattr(self._inner, name)

    return property(get, set_, delete, doc=f"The wrapped optimizer's ``{name}``.")


def _class_for(base: type) -> type:
    """The wrapper class for optimizers of class ``base``: DistributedOptimizer first in
    the MRO (its methods win), ``base`` next (``isinstance`` checks, custom methods)."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"Distributed{base.__name__}", (DistributedOptimizer, base),
                   {"__module__": __name__, "__qualname__": f"Distributed{base.__qualname__}"})
        _CLASSES[base] = cls
    return cls


class DistributedOptimizer(torch.optim.Optimizer):
    """Combines gradients across ranks with fused, overlapped exchanges, then steps.

    Args:
        optimizer: the torch optimizer to wrap (its class is kept, see the module doc).
        named_parameters: ``model.named_parameters()``; names appear in errors.
        compression: ``rt.Compression.none`` / ``.fp16`` / ``.bf16`` on the wire.
        backward_passes_per_step: local passes summed before each exchange.
        op: ``rt.Average`` (sum / size) or ``rt.Sum``.
        gradient_predivide_factor: Horovod's split of the average: ``1/f`` before the
            sum, ``f/size`` after it (Average only).
        strategy: ``"native"`` / ``"ring"`` / ``"ps"`` or a strategy object.
        fusion_mb: megabytes per fused bucket (default ``RINGTRAIN_FUSION_MB``, 25).
        sparse_as_dense: exchange sparse gradients as dense ones.
        sync_at: ``"backward"``: ``.grad`` holds the combined gradient when the backward
            that completes a step returns (DDP's semantics); ``"step"``: at ``step()`` or
            ``synchronize()`` (Horovod's).
        **strategy_options: options of the chosen strategy (``ps_servers``, ...).
    """

    def __new__(cls, optimizer: Any = None, *args: Any, **kwargs: Any) -> DistributedOptimizer:
        if cls is DistributedOptimizer and isinstance(optimizer, torch.optim.Optimizer) \
                and not isinstance(optimizer, DistributedOptimizer):
            cls = _class_for(type(optimizer))
        return object.__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        compression: Compressor = Compression.none,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        gradient_predivide_factor: float = 1.0,
        *,
        strategy: str | collectives.AllreduceAlgorithm = "native",
        fusion_mb: float | None = None,
        sparse_as_dense: bool = False,
        sync_at: str = "backward",
        **strategy_options: Any,
    ) -> None:
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError("this optimizer is already a DistributedOptimizer; wrap it once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not isinstance(compression, Compressor):
            raise ConfigError(
                f"compression must be rt.Compression.none, .fp16 or .bf16, got {compression!r}"
                + (" (pass strategy= by keyword)" if isinstance(compression, str) else "")
            )
        _check_passes(backward_passes_per_step)
        if sync_at not in ("backward", "step"):
            raise ConfigError(f"sync_at must be 'backward' (gradients combined when backward() "
                              f"returns, as DDP) or 'step' (in step(), as Horovod), got {sync_at!r}")
        runtime.world()  # raises NotInitializedError with a hint when rt.init() was not called
        self._inner = optimizer
        self._op = op
        self._compression = compression
        self._sparse_as_dense = bool(sparse_as_dense)
        self.backward_passes_per_step = backward_passes_per_step
        self._algorithm = sync.make_strategy(strategy, **strategy_options)
        self.strategy = strategy if isinstance(strategy, str) else type(strategy).__name__

        params, names, later = self._collect(named_parameters)
        periodic = [(n, claims.holder(p)) for n, p in zip(names, params, strict=True)
                    if claims.holder(p) is not None]
        if periodic:
            name, holder = periodic[0]
            raise ConfigError(
                f"{len(periodic)} of these parameters (first {name!r}) are synced by a live "
                f"rt.{type(holder).__name__}, which exchanges them every sync_every steps; a "
                "DistributedOptimizer would exchange their gradients after every backward as well. "
                "Use one exchange mode per parameter: drop the periodic one (del it) first")
        self._params = params
        self._names = names
        # Parameters frozen when wrapped (requires_grad False) stay out of the buckets;
        # one unfrozen later (fine-tuning that trains the head first) joins them at the
        # first step it has a gradient (_adopt_unfrozen), instead of stepping on its local
        # gradient while the others are averaged, which is how Horovod and DDP let the
        # replicas drift apart.
        self._later = later
        self._added = 0  # parameters add_param_group brought
        self._quiet: set[int] = set()  # ... adopted without the warning: DDP exchanges them too
        # sync_at="backward": a named parameter that no group holds but that trains (the
        # optimizer built over the head, the backbone added later or never) is exchanged
        # too, from its first gradient, as DDP averages every parameter of its model: a
        # clip over model.parameters() read its local gradient, and the ranks' clipped
        # updates differed (0.06 apart after 4 steps), silently. One that another
        # DistributedOptimizer exchanges is left to it (_elsewhere).
        self._passengers: set[int] = set()
        self._retired_by: str | None = None  # a parameter outside our groups a newer one took
        if sync_at == "backward":
            self._later += self._outside
            self._passengers = {id(p) for _, p in self._outside}
            self._quiet |= self._passengers
        mb = fusion_mb if fusion_mb is not None else runtime.settings().fusion_mb
        if not mb > 0:
            raise ConfigError(f"fusion_mb must be > 0, got {mb}")
        predivide = None if gradient_predivide_factor == 1.0 else float(gradient_predivide_factor)
        # A strategy may reduce over a subset of the ranks (a Horovod process set) and may
        # check its own layout (the coordinator matches every bucket by name).
        group_size = getattr(self._algorithm, "group_size", None)
        ranks = int(group_size()) if callable(group_size) else runtime.size()
        self._self_checking = bool(getattr(self._algorithm, "checks_layout", False))
        # A strategy that negotiates every collective (the Horovod coordinator) gathers
        # too: the sparse gradients and their first-step agreement then go through it, so
        # a rank that join()-ed is seen (on the default group it waited in join() while
        # the others waited for it in the gather, until the stall limit).
        gather = getattr(self._algorithm, "allgather", None)
        self._negotiated = callable(gather)
        self._gather: Callable[..., torch.Tensor] = gather if callable(gather) else collectives.allgather
        # sync_at="backward" (DDP's semantics): a parameter no rank had a gradient for
        # keeps .grad None, as DDP leaves a globally unused parameter, so the optimizer
        # skips it; as a zero gradient, weight decay and momentum moved it (AdamW by 0.08
        # in 3 steps) where one process and DDP leave it. Horovod (sync_at="step") gives
        # it zeros.
        self._fusion = FusedExchange(
            names, params, self._algorithm, compression, op, ranks, int(mb * 1024 * 1024),
            predivide=predivide, track_use=sync_at == "backward",
        )
        self._passes = [0] * len(params)
        self._next_launch = 0
        self._joined = _world_ref()  # the world whose size the exchange averages over
        self.sync_at = sync_at
        self._complete = False  # a parameter reached backward_passes_per_step this step
        self._end_queued = False  # the end-of-backward callback of this pass is queued
        # sync_at="backward" under compiled autograd, which runs no end-of-backward
        # callback: this step's exchange finishes in step() or synchronize() (see
        # _on_grad_ready), and `.grad` stays local until then.
        self._no_end = False
        self._synchronized = False  # this step's exchange is done
        self._user_synchronized = False  # ... by the script's own synchronize()
        self._steps = 0
        self._sparse: set[int] = set()  # agreed sparse parameters: gathered, not bucketed
        self._seen_sparse: set[int] = set()  # sparse gradients met by this rank this step
        self._lock = threading.Lock()
        self._layout_checked = False
        self._skip_next_sync = False
        self._densified: set[int] = set()  # sparse gradients sent dense (sparse_as_dense)
        # Exchanges of a step that load_state_dict dropped, by bucket: waited for before
        # the bucket's buffer is packed again (see load_state_dict).
        self._dropped: dict[int, tuple[Bucket, Any]] = {}
        # sync_at="step": what each launched bucket's members hold until the exchange is
        # finished (their local gradient, its version, the view to hand over then).
        self._handed: dict[int, list[tuple[int, torch.Tensor | None, int, torch.Tensor | None]]] = {}
        #: Seconds ``synchronize`` spent waiting for exchanges not hidden behind backward.
        self.last_exchange_wait_s = 0.0
        #: Seconds the wrapped optimizer's update took in the last ``step``.
        self.last_update_s = 0.0
        #: Called as ``fn(bucket_name, nbytes, t_launch, t_done)`` after each bucket's exchange.
        self.exchange_listeners: list[Callable[[str, int, float, float], None]] = []
        # The hooks reach this optimizer through a weak reference and go with it: an
        # optimizer built again for the same model (a new phase, a new learning-rate
        # recipe) used to leave the old one's hooks counting passes on the parameters.
        # A newer optimizer over a parameter takes it over from a live older one.
        me = weakref.ref(self)
        self._hook_handles = [p.register_post_accumulate_grad_hook(_hook(me, i))
                              for i, p in enumerate(params)]
        weakref.finalize(self, _remove_all, self._hook_handles)  # the list: adopted ones too
        self._retired = False
        for p in params:
            previous = _owner(p)
            if previous is not None and previous is not self:
                previous._retire(p)
            _OWNER[id(p)] = (weakref.ref(p, partial(_forget, id(p))), me)

    # -- the wrapped optimizer's state is ours ------------------------------------------
    # Properties, not copies: torch's load_state_dict replaces the containers, and a
    # copy taken earlier would silently stop reaching the real update.

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    # torch.amp.GradScaler.step(opt) on a fused optimizer (Adam/AdamW/SGD/Adagrad with
    # fused=True, whose _step_supports_amp_scaling reads through to here) sets these two
    # on ``opt`` and deletes them after the step; the fused kernel reads them from the
    # optimizer that steps, the wrapped one. Set on the wrapper, they never reached it:
    # the update used gradients still multiplied by the scale and stepped on an overflow
    # (SGD's parameters 8.5e5 off after 3 steps, NaN after an inf), silently.
    grad_scale = _forwarded("grad_scale")
    found_inf = _forwarded("found_inf")

    def __getattr__(self, name: str) -> Any:
        # Attributes the wrapped optimizer's own __init__ set (custom optimizers, torch
        # internals such as hook tables) live on it.
        inner = self.__dict__.get("_inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    # -- set-up -------------------------------------------------------------------------

    def _collect(
        self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None
    ) -> tuple[list[torch.nn.Parameter], list[str], list[tuple[str, torch.nn.Parameter]]]:
        """(parameters to exchange, their names, the frozen ones with names); keeps every
        name given in ``_name_of``, for a group added later (``add_param_group``), and in
        ``_outside`` the named ones outside the optimizer that require a gradient."""
        self._name_of: dict[int, str] = {}
        self._outside: list[tuple[str, torch.nn.Parameter]] = []
        every = list(dict.fromkeys(p for g in self._inner.param_groups for p in g["params"]))
        in_groups = [p for p in every if p.requires_grad]
        frozen = [p for p in every if not p.requires_grad]
        if named_parameters is None:
            return (in_groups, [f"param{i}" for i in range(len(in_groups))],
                    [(f"frozen{j}", p) for j, p in enumerate(frozen)])
        pairs = list(named_parameters)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
            raise ConfigError(
                "named_parameters must yield (name, parameter) pairs: pass model.named_parameters()"
            )
        names_seen: dict[str, int] = {}
        for n, _ in pairs:
            names_seen[n] = names_seen.get(n, 0) + 1
        dupes = sorted(n for n, c in names_seen.items() if c > 1)
        if dupes:
            raise ConfigError(
                f"named_parameters has duplicate names {dupes[:5]}: every parameter needs its own "
                "name (pass one model's named_parameters(), or prefix each model's names)"
            )
        by_id = {id(p): n for n, p in pairs}
        self._name_of = by_id
        mine = {id(p) for p in every}
        self._outside = [(n, p) for n, p in pairs if id(p) not in mine and p.requires_grad]
        missing = [i for i, p in enumerate(in_groups) if id(p) not in by_id]
        if missing:
            raise ConfigError(
                f"{len(missing)} parameter(s) of the optimizer are not in named_parameters; "
                "pass the same model's named_parameters() the optimizer was built from"
            )
        later = [(by_id.get(id(p), f"frozen{j}"), p) for j, p in enumerate(frozen)]
        return in_groups, [by_id[id(p)] for p in in_groups], later

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change the number of local passes per exchange (between steps)."""
        _check_passes(passes)
        if any(self._passes):
            raise ConfigError(
                "set_backward_passes_per_step() in the middle of an accumulation: call it "
                "after step(), before the next backward()"
            )
        self.backward_passes_per_step = passes

    # -- backward side ------------------------------------------------------------------

    def _retire(self, param: torch.Tensor | None = None) -> None:
        """A newer DistributedOptimizer covers some of our parameters (``param``, one of
        them): stop counting."""
        _remove_all(self._hook_handles)
        self._retired = True
        if param is not None and id(param) in self._passengers:
            self._retired_by = self._name_of.get(id(param), "?")

    def _on_grad_ready(self, index: int) -> None:
        with self._lock:
            # (the world's identity first: any() scans every parameter, once per hook)
            if self._joined() is not _world_now() and not any(self._passes) and not self._synchronized:
                # The first gradient of a step in another world than the last step's (a
                # resizable job re-formed; rt.shutdown() then rt.init()): an optimizer no
                # elastic state brought along (its model not in the state) averaged over
                # the old size, silently, where Horovod reads the size at every step.
                self.world_changed()
            if self._synchronized and self.sync_at == "backward" and not self._user_synchronized:
                # Another backward before step() (accumulation without DDP's no_sync()):
                # DDP exchanges it again, adding to the .grad that is already the
                # average, so the result is the average of the passes' sum. Start a new
                # round of this step's exchange (backward_passes_per_step=k exchanges
                # once per k passes instead).
                self._reset(step_done=False)
            if self._synchronized:
                raise OptimizerUsageError(
                    f"backward() reached parameter {self._names[index]!r} after this step's "
                    "gradients were exchanged (by synchronize(), or by the backward that "
                    f"completed the step: backward_passes_per_step={self.backward_passes_per_step})"
                    " and before step(): call step() first, or zero_grad() to drop the step; "
                    "to accumulate more passes raise backward_passes_per_step"
                )
            self._passes[index] += 1
            count = self._passes[index]
            if count > self.backward_passes_per_step:
                raise OptimizerUsageError(
                    f"parameter {self._names[index]!r} got {count} backward passes but "
                    f"backward_passes_per_step={self.backward_passes_per_step}; call step() "
                    "after that many passes or raise backward_passes_per_step"
                    + ("" if not self._no_end else
                       " (under compiled autograd a backward does not finish the exchange, so "
                       "each backward before step() is one of those passes)")
                )
            if self.sync_at == "backward" and not self._end_queued:
                self._end_queued = True
                if _in_compiled_autograd():
                    # Compiled autograd drops a callback queued from a hook it runs
                    # untraced, so nothing would finish the exchange when backward ends:
                    # `.grad` became a view of the buffer still being summed, a clip
                    # between backward() and step() scaled it mid-exchange and the
                    # replicas drifted apart (0.05 in 4 steps). This step goes as under
                    # sync_at="step": `.grad` stays local until step() or synchronize().
                    self._no_end = True
                else:
                    # Runs once this backward has finished, as DDP's reducer finalises there.
                    torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            if count == self.backward_passes_per_step:
                self._complete = True
            if count < self.backward_passes_per_step or index not in self._fusion.bucket_of:
                return  # still accumulating, or a sparse parameter (gathered at synchronize)
            bucket, _ = self._fusion.bucket_of[index]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch strictly in plan order so every rank issues the same collective sequence.
        buckets = self._fusion.buckets
        while self._next_launch < len(buckets):
            bucket = buckets[self._next_launch]
            if bucket.pending > 0:
                return
            self._launch(bucket)

    def _dense_grad(self, index: int) -> torch.Tensor | None:
        """This step's gradient of a bucketed parameter, dense (None: contribute zeros).
        A gradient no backward reached this step (set by hand, from autograd.grad; or
        the last step's, stepped again) is exchanged as it is, as Horovod does; only a
        parameter without one contributes zeros."""
        grad = self._params[index].grad
        if grad is None:
            return None
        if grad.is_sparse:
            if self._sparse_as_dense or self._steps > 0:
                # Densified: asked for, or a parameter whose first sparse gradient came
                # after the first step (the ranks agreed on the sparse set then). The
                # result is made sparse again, so optimizers that need sparse gradients
                # (SparseAdam) still work.
                self._densified.add(index)
                return grad.to_dense()
            # First step: gathered at synchronize(), where every rank agrees on the sparse
            # parameters; its bucket slot carries zeros this once.
            self._seen_sparse.add(index)
            return None
        return grad

    def _frozen(self, index: int) -> bool:
        """A parameter frozen since wrapping (``requires_grad_(False)``) with no gradient:
        under ``sync_at="backward"`` its ``.grad`` stays None, as DDP leaves it, so the
        optimizer does not move it (momentum, weight decay); it still sends zeros, so
        every rank's buckets keep their layout. Horovod gives it a zero gradient."""
        p = self._params[index]
        return self.sync_at == "backward" and not p.requires_grad and p.grad is None

    def _launch(self, bucket: Bucket) -> None:
        if not self._layout_checked and not self._self_checking:
            self._layout_checked = True
            tensors, shared = self._fusion.signature()
            shared["backward_passes_per_step"] = str(self.backward_passes_per_step)
            shared["sparse_as_dense"] = str(self._sparse_as_dense)
            sync.check_exchange(self._algorithm, tensors, shared,
                                when="first step" if self._steps == 0 else "bucket layout change")
        dropped = self._dropped.pop(id(bucket), None)
        if dropped is not None:  # a step load_state_dict dropped: its exchange writes this buffer
            try:
                dropped[1].wait()
            except Exception:  # noqa: BLE001 - its step is gone; this exchange reports a broken world
                log.debug("%s: the dropped step's exchange failed", bucket.name, exc_info=True)
        members = bucket.spec.params
        grads = [self._dense_grad(i) for i in members]
        keep = self.sync_at == "step" or self._no_end
        # sync_at="step": a `.grad` accumulated in place (zero_grad(set_to_none=False))
        # is a view of the buffer; exchanged as it was, the script saw it pre-scaled by
        # 1/size and a clip before synchronize() reached the sum in flight, silently.
        views = self._fusion.pack(bucket, grads, keep_grads=keep)
        if keep:
            # Under Horovod's contract the script runs between here and synchronize():
            # `.grad` stays the local gradient until the exchange is done, so a change to
            # it (clipping before synchronize()) cannot reach the buffer in flight, where
            # it made the ranks' results differ. It is discarded, with a warning.
            lo = bucket.flat.data_ptr()
            hi = lo + bucket.nbytes
            handed = []
            for index, view in zip(members, views, strict=True):
                if index in self._seen_sparse or self._frozen(index):
                    continue
                grad = self._params[index].grad  # the script's tensor (not a densified copy)
                local = (grad if grad is not None and not grad.is_sparse and not lo <= grad.data_ptr() < hi
                         else None)
                handed.append((index, local, local._version if local is not None else 0,
                               view if bucket.grad_views else None))
            self._handed[bucket.spec.index] = handed
        elif bucket.grad_views:
            for index, view in zip(members, views, strict=True):
                if index not in self._seen_sparse and not self._frozen(index):
                    self._params[index].grad = view
        self._fusion.launch(bucket)
        self._next_launch += 1

    @_eager
    def _backward_ended(self) -> None:
        """End of a backward pass (``sync_at="backward"``): the pass that completes the
        step waits for the exchange, so ``.grad`` is combined when ``backward()`` returns."""
        outer = torch._C._current_autograd_node()
        if outer is not None:
            # A backward run inside a node of another one (reentrant activation
            # checkpointing): ours queued its callback here when its gradients came
            # first, but the outer backward has more to come. Queue it again from a hook
            # that runs after that node, in the outer backward.
            outer.register_hook(lambda *_: self._queue_end())
            return
        self._end_queued = False
        if self._complete:
            self._finish_exchange()

    def _queue_end(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    # -- step side ----------------------------------------------------------------------

    @_eager
    def synchronize(self) -> None:
        """Finish this step's gradient exchange; afterwards ``.grad`` holds the result."""
        self._check_live()
        self._finish_exchange()
        self._user_synchronized = True

    def _finish_exchange(self) -> None:
        if self._synchronized:
            return
        t0 = time.perf_counter()
        with self._lock:
            for bucket in self._fusion.buckets:
                bucket.pending = 0
            self._launch_ready()
        changed: list[str] = []
        for bucket in self._fusion.buckets:
            self._fusion.wait(bucket)
            t_done = time.perf_counter()
            for fn in self.exchange_listeners:
                fn(bucket.name, bucket.nbytes, bucket.launched_at, t_done)
            if events.active():
                names = [self._names[i] for i in bucket.spec.params]
                events.emit("exchange", bucket.launched_at, t_done, name=bucket.name,
                            bytes=bucket.nbytes, tensors=names)
            changed += self._hand_over(bucket)
            unused = self._unused(bucket)
            if not bucket.grad_views:
                self._unpack(bucket, unused)
        if changed and not self._no_end:
            warnings.warn(
                f"the gradients of {len(changed)} parameter(s) (first {changed[0]!r}) changed after "
                "backward() and before optimizer.synchronize() (clipping? scaling?): the exchange "
                "had already taken them, so the change is discarded. Call optimizer.synchronize() "
                "first, change the gradients, then step inside 'with optimizer.skip_synchronize():' "
                "(Horovod's recipe), or use sync_at='backward'", stacklevel=3)
        self._exchange_sparse()
        if self._later:
            self._adopt_unfrozen()
        if self._densified:
            with torch.no_grad():
                for index in self._densified:
                    p = self._params[index]
                    if p.grad is not None and not p.grad.is_sparse:
                        p.grad = p.grad.to_sparse(1)
        t_end = time.perf_counter()
        self.last_exchange_wait_s = t_end - t0
        if events.active():
            events.emit("exchange_wait", t0, t_end)
        self._synchronized = True
        # After the bookkeeping, so the optimizer is consistent: zero_grad() drops the step.
        if changed and self._no_end:
            raise OptimizerUsageError(
                f"the gradients of {len(changed)} parameter(s) (first {changed[0]!r}) changed "
                "between backward() and the end of their exchange (clipping? unscale_?): under "
                "compiled autograd backward() returns before the gradients are combined, so the "
                "change reached only this rank's gradients; call optimizer.synchronize() after "
                "backward() and change them after it (then step inside 'with "
                "optimizer.skip_synchronize():'), or turn compiled autograd off")

    def _hand_over(self, bucket: Bucket) -> list[str]:
        """sync_at="step": the exchange of ``bucket`` is done; its members' ``.grad``
        become the result. Returns the names of local gradients changed meanwhile."""
        handed = self._handed.pop(bucket.spec.index, None)
        if handed is None:
            return []
        changed = [self._names[index] for index, local, version, _ in handed
                   if local is not None and (self._params[index].grad is not local or local._version != version)]
        for index, _, _, view in handed:
            if view is not None:
                self._params[index].grad = view
        return changed

    def _adopt_unfrozen(self) -> None:
        """Parameters frozen at wrapping that have a gradient now: exchange this step's
        gradients of them on their own, then make them members like the others (hooks,
        buckets), so from the next step on they travel overlapped with backward. Every
        rank meets them at the same step; the store check below names a rank that did
        not (a rank-dependent ``requires_grad``) instead of pairing unlike exchanges."""
        # Parameters outside the groups join together at the first exchange, whether this
        # rank used them or not (zeros then, as DDP's unused ones), so every rank adopts the
        # same set even where only some ranks use one.
        new = [(n, p) for n, p in self._later if p.requires_grad
               and (p.grad is not None or id(p) in self._passengers)
               and not (id(p) in self._passengers and self._elsewhere(p))]
        if not new:
            return
        for _, p in new:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for _, p in new if p.grad is not None]
        sparse = [n for (n, _), g in zip(new, grads, strict=True) if g.is_sparse]
        if sparse:
            raise OptimizerUsageError(
                f"parameter {sparse[0]!r} was frozen when the optimizer was wrapped and has a "
                "sparse gradient now; wrap the optimizer again after unfreezing it")
        names = [n for n, _ in new]
        unfrozen = [n for n, p in new if id(p) not in self._quiet]
        if unfrozen:
            warnings.warn(
                f"{len(unfrozen)} parameter(s) frozen when the DistributedOptimizer was wrapped "
                f"have gradients now (first {unfrozen[0]!r}): their gradients are combined "
                "across ranks from this step on (Horovod and DDP leave them local, and replicas "
                "drift)", stacklevel=3)
        tensors = [p for _, p in new]
        if not self._self_checking:
            sync.check_exchange(self._algorithm, [(n, tuple(p.shape), p.dtype) for n, p in new],
                                {"op": self._op.name}, when="parameters unfrozen since wrapping")
        once = FusedExchange(names, tensors, self._fusion.strategy, self._compression, self._op,
                             self._fusion.size, self._fusion.bucket_bytes,
                             predivide=self._fusion.predivide, label="unfrozen")
        for bucket in once.buckets:
            once.pack(bucket, [grads[i] for i in bucket.spec.params])
            once.launch(bucket)
        with torch.no_grad():
            for bucket in once.buckets:
                once.wait(bucket)
                for position, index in enumerate(bucket.spec.params):
                    grads[index].copy_(once.result(bucket, position))
        me = weakref.ref(self)
        for name, p in new:
            index = len(self._params)
            self._params.append(p)
            self._names.append(name)
            self._passes.append(self.backward_passes_per_step)
            handle = p.register_post_accumulate_grad_hook(_hook(me, index))
            self._hook_handles.append(handle)
            previous = _owner(p)
            if previous is not None and previous is not self:
                previous._retire(p)
            _OWNER[id(p)] = (weakref.ref(p, partial(_forget, id(p))), me)
        adopted = {id(p) for p in tensors}
        self._quiet -= adopted
        self._later = [(n, p) for n, p in self._later if id(p) not in adopted]
        self._fusion.add(names, tensors, [i for i in range(len(self._params)) if i not in self._sparse])
        self._layout_checked = False

    def _elsewhere(self, p: torch.Tensor) -> bool:
        """A parameter outside our groups that another live DistributedOptimizer (two
        optimizers over one model's named_parameters) or a periodic one exchanges, or
        with a sparse gradient: not ours to exchange."""
        other = _owner(p)
        return ((other is not None and other is not self and not other._retired)
                or claims.holder(p) is not None or (p.grad is not None and p.grad.is_sparse))

    def _unused(self, bucket: Bucket) -> set[int]:
        """Members (positions) no rank had a gradient for: their ``.grad`` is None again."""
        found = {p for p in self._fusion.unused(bucket)
                 if bucket.spec.params[p] not in self._seen_sparse}
        for position in found:
            self._params[bucket.spec.params[position]].grad = None
        return found

    def _unpack(self, bucket: Bucket, unused: set[int] | None = None) -> None:
        unused = unused or set()
        with torch.no_grad():
            for position, index in enumerate(bucket.spec.params):
                if index in self._seen_sparse or self._frozen(index) or position in unused:
                    continue
                p = self._params[index]
                result = self._fusion.result(bucket, position)
                if p.grad is None or p.grad.is_sparse or p.grad.shape != result.shape:
                    p.grad = result
                else:
                    p.grad.copy_(result)

    def _exchange_sparse(self) -> None:
        if self._steps == 0:
            # Agree on the sparse parameters once: a rank whose embedding got no gradient
            # in this step must still take part in gathering the others'.
            flags = torch.zeros(len(self._params), dtype=torch.int32)
            for i in self._seen_sparse:
                flags[i] = 1
            if self._negotiated:
                self._fusion.strategy(flags, Max, "sparse gradients (first step)").wait()
            else:
                collectives.allreduce_(flags, Max, name="sparse gradients (first step)")
            agreed = {i for i in range(len(self._params)) if flags[i]}
            self._seen_sparse = agreed
        todo = sorted(self._sparse | self._seen_sparse)
        if todo and self._fusion.size != runtime.size():
            # Gathered over the whole world, they would be averaged over it, and a rank
            # outside the set would take the others' rows (Horovod gathers over the set).
            raise ConfigError(
                f"sparse gradients ({', '.join(self._names[i] for i in todo[:3])}) with a "
                f"process set of {self._fusion.size} of the {runtime.size()} ranks are not "
                "supported; pass sparse_as_dense=True to exchange them as dense gradients")
        for index in todo:
            self._gather_sparse(index)
        if self._seen_sparse - self._sparse:
            # From the next step on the sparse parameters stay out of the buckets.
            self._sparse |= self._seen_sparse
            self._fusion.plan([i for i in range(len(self._params)) if i not in self._sparse])
            self._layout_checked = False

    def _gather_sparse(self, index: int) -> None:
        p = self._params[index]
        grad = p.grad if self._passes[index] else None
        if grad is None:
            grad = torch.sparse_coo_tensor(
                torch.zeros((1, 0), dtype=torch.int64, device=p.device),
                torch.zeros((0, *p.shape[1:]), dtype=p.dtype, device=p.device), p.shape)
        elif not grad.is_sparse:
            grad = grad.to_sparse(1)
        grad = grad.coalesce()
        name = self._names[index]
        indices = self._gather(grad.indices().t().contiguous(), name=f"{name} (sparse indices)")
        values = self._gather(grad.values().contiguous(), name=f"{name} (sparse values)")
        factor = 1.0 / runtime.size() if self._op is Average else 1.0
        with torch.no_grad():
            p.grad = torch.sparse_coo_tensor(indices.t(), values * factor if factor != 1.0 else values,
                                             p.shape).coalesce()

    def _reset(self, step_done: bool = True) -> None:
        """Start the next step (or, ``step_done=False``, another exchange round of this
        one: a backward after the exchange under ``sync_at="backward"``)."""
        for bucket in self._fusion.buckets:
            bucket.pending = len(bucket.spec.params)
            bucket.handle = None
        self._passes = [0] * len(self._params)
        self._next_launch = 0
        self._complete = False
        self._end_queued = False  # a backward that raised never ran its callback
        self._no_end = False
        self._synchronized = False
        self._user_synchronized = False
        self._seen_sparse = set()
        self._densified = set()
        self._handed = {}
        if step_done:
            self._steps += 1

    def world_changed(self) -> None:
        """The job moved to a world of another size (a resizable job, ``rt.elastic``):
        forget an interrupted step, average over the new number of ranks, and run the
        first-step agreements (layout check, sparse parameters) again, as the ranks that
        just started do."""
        self._reset()
        self._dropped.clear()  # the old world's exchanges: never waited for in the new one
        self._joined = _world_ref()
        group_size = getattr(self._algorithm, "group_size", None)
        self._fusion.size = int(group_size()) if callable(group_size) else runtime.size()
        self._steps = 0
        self._layout_checked = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Run ``step()`` without the warning for a ``synchronize()`` the script called
        (Horovod's recipe for clipping: ``synchronize()``, clip, then ``step()`` in here)."""
        if not self._synchronized:
            raise ConfigError(
                "skip_synchronize() without synchronize(): call opt.synchronize() first, "
                "then clip, then 'with opt.skip_synchronize(): opt.step()'"
            )
        self._skip_next_sync = True
        try:
            yield
        finally:
            self._skip_next_sync = False

    def _check_live(self) -> None:
        if self._retired:
            raise ConfigError(
                "this DistributedOptimizer was replaced: a newer one wraps some of the same "
                "parameters, and only the newest exchanges their gradients; step the new one "
                "(or wrap disjoint parameters in each)"
                + ("" if self._retired_by is None else
                   f"; its parameter {self._retired_by!r} is in none of this optimizer's groups, "
                   "but named_parameters named it, so this one exchanged it from its first step "
                   "(as DDP averages every parameter of its model): give each optimizer only its "
                   "own parameters' names, or build every optimizer before the first step"))

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        self._check_live()
        if self._user_synchronized and not self._skip_next_sync:
            # Horovod warns here: gradients changed after synchronize() (clipping) are
            # used as they are, which is what the script wants only inside skip_synchronize().
            warnings.warn(
                "optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(). This can cause training slowdown. You may want to "
                "consider using optimizer.skip_synchronize() context if you use "
                "optimizer.synchronize() in your code.", stacklevel=2)
        evaluate, first, t0 = self._before_update(closure)
        result: Any
        try:
            if evaluate is not None:
                self._inner.step(evaluate)
                result = first[0] if first else None
            else:
                result = self._inner.step(closure) if closure is not None else self._inner.step()
        finally:
            self._after_update(t0)
        return result

    @_eager
    def _before_update(self, closure: Callable[[], float] | None
                       ) -> tuple[Callable[[], Any] | None, list[Any], float]:
        """The exchange finished (or the closure that computes it), and the update's start."""
        self._skip_next_sync = False
        evaluate = None
        first: list[Any] = []  # the closure's first local loss, what step() returns under DDP
        if closure is not None and not any(self._passes) and not self._synchronized:
            # The closure computes this step's gradients (LBFGS, or SGD given one).
            evaluate = self._evaluator(closure, first)
        else:
            self._finish_exchange()
        return evaluate, first, time.perf_counter()

    @_eager
    def _after_update(self, t0: float) -> None:
        t_end = time.perf_counter()
        self.last_update_s = t_end - t0
        if events.active():
            events.emit("update", t0, t_end)
            events.emit("step_end", t_end, t_end)
        self._reset()
        events.check_stop()  # the doctor has its steps: leave here, nothing in flight

    def _evaluator(self, closure: Callable[[], Any], first: list[Any]) -> Callable[[], Any]:
        """``closure`` as the optimizer must call it here: each call's backward is one
        exchange, finished before the optimizer reads ``.grad``, and the loss it returns
        is averaged over the ranks. An optimizer that decides on the loss (LBFGS's line
        search and stopping test) then takes the same decisions, and the same number of
        calls, on every rank, as one process on the global batch would; with the local
        loss, ranks would stop at different calls and their exchanges would pair up
        gradients of different calls. ``first`` gets the first call's own loss: torch's
        optimizers return it from ``step()``, and so does this one, as under DDP and
        Horovod (the average is only what the wrapped optimizer decides on)."""
        calls = 0

        def evaluate() -> Any:
            nonlocal calls
            if calls:
                self._reset()  # the last call's exchange is done: this backward is a new one
            calls += 1
            loss = closure()
            if not first:
                first.append(loss)
            self._finish_exchange()
            return self._mean_loss(loss)

        return evaluate

    def _mean_loss(self, loss: Any) -> Any:
        if loss is None or self._fusion.size == 1:
            return loss
        local = loss.detach().item() if isinstance(loss, torch.Tensor) else float(loss)
        value = torch.tensor([local], dtype=torch.float64)
        self._fusion.strategy(value, Sum, f"{self._fusion.label} closure loss").wait()
        mean = value.item() / self._fusion.size
        if isinstance(loss, torch.Tensor):
            return torch.tensor(mean, dtype=loss.dtype, device=loss.device)
        return mean

    # -- delegation ---------------------------------------------------------------------

    @_eager
    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(self._passes) and not self._synchronized:
            raise OptimizerUsageError(
                "zero_grad() was called after backward() and before step(): this step's "
                "gradients are being accumulated or exchanged with the other ranks. Call "
                "zero_grad() before backward() (or after step()); with gradient "
                "accumulation, after the step that ends it"
                + ("; to skip a step, call synchronize() first" if self.sync_at == "step" or self._no_end
                   else "")
            )
        if self._synchronized:
            # The exchange is done and no step() came: the script skips this update
            # (GradScaler found an inf, a non-finite norm). The next backward starts a step.
            self._reset()
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state; a step in progress is dropped, as Horovod's
        ``load_state_dict`` drops it: a rollback (``backward()``, then the saved state
        loaded, then ``zero_grad()``) starts the next step afresh, its accumulation
        count too.

        Exchanges already launched are not waited for here, as Horovod does not wait
        for them: the other ranks may never send theirs (rank 0 alone built the
        checkpoint's state with a backward, Horovod's resume recipe), and waiting hung
        it. Each is waited for before its bucket's buffer is packed again, so none
        writes into the next step's exchange; one that fails then is let go with the
        step it belonged to."""
        if any(self._passes) or self._synchronized:
            for bucket in self._fusion.buckets:
                if bucket.handle is not None:
                    self._dropped[id(bucket)] = (bucket, bucket.handle)
            self._reset(step_done=False)
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer (a backbone trained later, with its own
        learning rate). Its parameters are exchanged from the first step they have a
        gradient, as those frozen at wrapping (``_adopt_unfrozen``), without the warning:
        DDP averages every parameter of its model whichever optimizer steps it, so such a
        script trains as one process on the global batch there. Horovod never exchanges
        an added parameter, and its replicas drift apart silently."""
        self._check_live()
        known = {id(p) for p in self._params} | {id(p) for _, p in self._later}
        self._inner.add_param_group(param_group)  # torch checks the group (duplicates, options)
        group = self._inner.param_groups[-1]["params"]
        new = [p for p in group if id(p) not in known]
        periodic = [p for p in new if claims.holder(p) is not None]
        if periodic:
            holder = claims.holder(periodic[0])
            del self._inner.param_groups[-1]
            raise ConfigError(
                f"{len(periodic)} parameter(s) of the new group are synced by a live "
                f"rt.{type(holder).__name__}; a DistributedOptimizer would exchange their "
                "gradients after every backward as well: drop the periodic one (del it) first")
        self._passengers -= {id(p) for p in group}  # in a group now: exchanged as any member
        for p in new:
            self._added += 1
            self._later.append((self._name_of.get(id(p), f"added{self._added - 1}"), p))
            self._quiet.add(id(p))
        if self._synchronized:
            # Added between the exchange and step() (after backward() under DDP's
            # semantics): the exchange is over, so exchange the new gradients now, or this
            # step would use each rank's own.
            self._adopt_unfrozen()

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self._inner.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self._inner.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self._inner.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self._inner.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self._inner.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable[..., Any], prepend: bool = False) -> Any:
        return self._inner.register_load_state_dict_post_hook(hook, prepend)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistributedOptimizer cannot be pickled; save opt.state_dict() instead")

    @property
    def wrapped(self) -> torch.optim.Optimizer:
        return self._inner

    @property
    def pending_passes(self) -> int:
        """Backward passes accumulated toward a step that has not been taken yet (0 between
        steps): gradients a checkpoint taken now would not hold."""
        return 0 if self._synchronized else max(self._passes, default=0)

    @property
    def exchange_started(self) -> bool:
        """This step's exchange has begun (a bucket was launched) and is not finished."""
        return self._next_launch > 0 and not self._synchronized

    @property
    def bucket_names(self) -> list[str]:
        return [b.name for b in self._fusion.buckets]

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({type(self._inner).__name__}, strategy={self.strategy!r}, "
            f"buckets={len(self._fusion.buckets)}, compression={self._compression!r})"
        )


def _check_passes(passes: Any) -> None:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ConfigError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")


#: The newest DistributedOptimizer over each parameter, by id (see __init__; a
#: WeakKeyDictionary would compare tensors with ==).
_OWNER: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[DistributedOptimizer]]] = {}


def owner_of(param: torch.Tensor) -> DistributedOptimizer | None:
    """The live DistributedOptimizer exchanging ``param``'s gradient, or None."""
    return _owner(param)


def _owner(param: torch.Tensor) -> DistributedOptimizer | None:
    entry = _OWNER.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _forget(key: int, _ref: Any) -> None:
    _OWNER.pop(key, None)


def _world_now() -> Any:
    """The world this process is in (None between two worlds of a resizable job)."""
    return runtime.world() if runtime.is_initialized() else None


def _world_ref() -> Callable[[], Any]:
    """A weak reference to the current world (one that answers None when there is none)."""
    now = _world_now()
    return weakref.ref(now) if now is not None else lambda: None


def _in_compiled_autograd() -> bool:
    """A hook runs inside a backward that compiled autograd executes (which runs no
    callback queued on the engine). Its module is imported only by a script that uses
    torch.compile, so it is looked up, never imported here."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False))


def _hook(owner: weakref.ref[DistributedOptimizer], index: int) -> Callable[[torch.Tensor], None]:
    @_eager  # autograd calls it inside a compiled step's frame too: not traced (see _eager)
    def hook(_param: torch.Tensor) -> None:
        opt = owner()
        if opt is not None:
            opt._on_grad_ready(index)

    return hook


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
