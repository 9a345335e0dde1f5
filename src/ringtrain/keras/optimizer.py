"""DistributedOptimizer for Keras 3: combine gradients across ranks before Keras applies them.

On the torch backend a Keras ``fit`` step runs ``loss.backward()`` and then calls
``optimizer.apply(grads, variables)``. The wrapper overrides ``apply``: the gradients
go through the same fused exchange as the torch optimizer (:mod:`ringtrain.fusion`:
flat buffers, scaling, compression, one asynchronous exchange per buffer through the
chosen strategy, a first-step layout check) and are then handed to the wrapped
optimizer's own ``apply`` (clipping, weight decay, the update).

Semantics are Horovod's Keras wrapper's: ``backward_passes_per_step=k`` sums k local
passes and applies once (``average_aggregated_gradients=True`` divides that sum by the
passes) while ``iterations`` counts every pass, ``op=Average`` divides by ``size()`` only.

From the second step on, each bucket's exchange starts during backward, as soon as
autograd has accumulated its last gradient (:mod:`ringtrain.keras.overlap`), as the
torch :class:`ringtrain.DistributedOptimizer` does; ``apply`` only launches what is left
and waits. ``overlap=False`` exchanges after backward instead (for a ``train_step`` that
changes gradients in place before ``apply``).

Like Horovod's Keras wrapper, the result is an instance of a subclass of the
optimizer's own class, rebuilt from its config, so ``isinstance`` checks, learning-rate
attributes and ``model.save`` behave as for the original; a saved model loads back as
the plain Keras optimizer.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringtrain import runtime, sync
from ringtrain.collectives import Average, Min, ReduceOp, allreduce_
from ringtrain.compression import Compression, Compressor
from ringtrain.errors import ConfigError
from ringtrain.fusion import FusedExchange
from ringtrain.keras._backend import load_keras
from ringtrain.keras.overlap import BackwardOverlap

__all__ = ["DistributedOptimizer", "GradientExchange", "PartialDistributedOptimizer", "whole_job"]

keras = load_keras()


class GradientExchange:
    """Combines a list of torch gradients across ranks (no Keras objects: custom loops can use it).

    ``reduce(grads, params)`` returns the combined gradients every
    ``backward_passes_per_step``-th call and ``None`` on the calls in between, which
    only accumulate (sum) locally. ``flush()`` exchanges what has accumulated so far. A
    gradient that is ``None`` on a rank contributes zeros (the exchange must have the
    same layout on every rank).

    With ``overlap`` (default) hooks on ``params`` start each bucket's exchange during
    backward from the second call on, when ``grads`` are the tensors backward
    accumulated into ``.grad`` (see :mod:`ringtrain.keras.overlap`).
    """

    def __init__(
        self,
        compression: Compressor = Compression.none,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        fusion_mb: float | None = None,
        strategy: str = "native",
        average_aggregated_gradients: bool = False,
        gradient_predivide_factor: float = 1.0,
        overlap: bool = True,
    ) -> None:
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ConfigError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        if not isinstance(compression, Compressor):
            # A string here is most often Horovod's positional name= (its second argument).
            hint = (" (Horovod's DistributedOptimizer takes name second: pass name=, compression= "
                    "and the rest by keyword)" if isinstance(compression, str) else "")
            raise ConfigError(
                f"compression must be rt.Compression.none, .fp16 or .bf16, got {compression!r}{hint}"
            )
        runtime.world()  # NotInitializedError with the hint to call rt.init() first
        mb = fusion_mb if fusion_mb is not None else runtime.settings().fusion_mb
        if not mb > 0:
            raise ConfigError(f"fusion_mb must be > 0, got {mb}")
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.strategy = strategy
        self.average_aggregated_gradients = bool(average_aggregated_gradients)
        self._algorithm = sync.make_strategy(strategy)  # unknown names: ConfigError with choices
        self._predivide = None if gradient_predivide_factor == 1.0 else float(gradient_predivide_factor)
        self._bucket_bytes = int(mb * 1024 * 1024)
        self._layout: tuple[Any, ...] | None = None
        self._fusion: FusedExchange | None = None
        self._sums: list[torch.Tensor | None] = []
        self._passes = 0
        self.overlap = bool(overlap)
        self._overlap: BackwardOverlap | None = None
        self._warned_mismatch = False
        # Validate op (and the factor) now rather than at the first step.
        from ringtrain.fusion import scaling

        scaling(op, 1, False, self._predivide)
        #: Seconds the last exchange kept ``reduce`` waiting (pack, launch, wait): with
        #: overlap, only the part not hidden behind backward. For step meters.
        self.last_exchange_s = 0.0

    def stop_overlap(self) -> None:
        """Exchange after backward from now on (finishing and unhooking any overlap)."""
        self.overlap = False
        if self._overlap is not None:
            self._overlap.detach()
            self._overlap = None

    @property
    def pending_passes(self) -> int:
        """Passes accumulated locally and not exchanged yet."""
        return self._passes

    def reduce(
        self, grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor],
        names: Sequence[str] | None = None,
    ) -> list[torch.Tensor | None] | None:
        """Add one pass of ``grads`` (one per tensor of ``params``); combined grads when due
        (None for a tensor no rank had a gradient for).

        The returned tensors may be views of reused buffers: apply them before the next
        ``reduce``/``flush`` (Keras does), or copy them.
        """
        if len(grads) != len(params):
            raise ConfigError(f"got {len(grads)} gradients for {len(params)} variables")
        self._prepare(params, names)
        overlap = self._overlap
        if overlap is not None and self._passes + 1 == self.backward_passes_per_step \
                and overlap.started():
            if overlap.matches(grads):
                return self._finish_overlapped(overlap, grads)
            overlap.drain()  # every rank launched them; finish, then exchange what was given
            if not self._warned_mismatch:
                self._warned_mismatch = True
                warnings.warn(
                    "ringtrain.keras: apply() got other gradients than backward left in .grad, "
                    "so the exchanges started during backward were repeated; pass overlap=False "
                    "to DistributedOptimizer/GradientExchange to exchange once, after backward",
                    stacklevel=3)
        out: list[torch.Tensor | None] | None
        if self.backward_passes_per_step == 1:
            out = self._exchange(list(grads), 1)  # no accumulation: pack straight from them
        else:
            self._accumulate(grads)
            self._passes += 1
            if self._passes < self.backward_passes_per_step:
                return None
            out = self.flush()
        if self.overlap and (self._overlap is None or not self._overlap.attached):
            self._attach(params)  # the next steps start their exchanges during backward
        return out

    def _accumulate(self, grads: Sequence[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is not None:
                    self._add(i, g)

    def _add(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """Add one pass's gradient to the local sum of ``index``; the sum."""
        acc = self._sums[index]
        if acc is None:
            acc = self._sums[index] = grad.detach().clone()
        else:
            acc.add_(grad)
        return acc

    def flush(self) -> list[torch.Tensor | None] | None:
        """Exchange what has accumulated (fewer passes than usual is fine); None if nothing."""
        if self._passes == 0:
            return None
        out = self._exchange(self._sums, self._passes)
        self._sums = [None] * len(self._sums)
        self._passes = 0
        return out

    # -- internals ----------------------------------------------------------------------

    def _prepare(self, params: Sequence[torch.Tensor], names: Sequence[str] | None) -> None:
        layout = tuple((id(p), tuple(p.shape), p.dtype, p.device) for p in params)
        if layout == self._layout:
            return
        if self._passes:
            raise ConfigError(
                "the variables changed in the middle of a gradient accumulation "
                f"(backward_passes_per_step={self.backward_passes_per_step}); pass the same "
                "variables on every call, or call flush() before switching"
            )
        if self._overlap is not None:
            self._overlap.detach()  # hooks of the old layout: finish their exchanges, remove
            self._overlap = None
        labels = list(names) if names is not None else [f"grad{i}" for i in range(len(params))]
        # track_use: a variable no rank had a gradient for gets None back, which Keras
        # skips as it does in one process (and Horovod's Keras wrapper never exchanges);
        # a zero gradient let weight decay move it (AdamW: 1.0 to 0.970 in 6 steps).
        self._fusion = FusedExchange(labels, params, self._algorithm, self.compression, self.op,
                                     runtime.size(), self._bucket_bytes, self._predivide,
                                     label="keras.bucket", track_use=True)
        self._sums = [None] * len(params)
        # Ranks that exchange different layouts hang or average unrelated numbers
        # (horovod/horovod#2107, #1559); compare once per layout, through the store.
        tensors, shared = self._fusion.signature()
        shared["backward_passes_per_step"] = str(self.backward_passes_per_step)
        shared["average_aggregated_gradients"] = str(self.average_aggregated_gradients)
        sync.check_exchange(self._algorithm, tensors, shared, when="first Keras step",
                            what="Keras gradients")
        self._layout = layout

    def _attach(self, params: Sequence[torch.Tensor]) -> None:
        fusion = self._fusion
        assert fusion is not None  # set by _prepare
        k = self.backward_passes_per_step

        def due() -> bool:  # the backward pass whose gradients get exchanged
            return self._passes + 1 == k

        def source(index: int, grad: torch.Tensor) -> torch.Tensor:
            # Out of place: if apply() turns out to get other gradients, the local sums
            # must still be those of the earlier passes.
            acc = self._sums[index] if k > 1 else None
            return grad if acc is None else acc + grad

        if self._overlap is None:
            self._overlap = BackwardOverlap(fusion, params, due, source)
        self._overlap.attach()

    def _finish_overlapped(self, overlap: BackwardOverlap,
                           grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        t0 = time.perf_counter()
        passes = self._passes + 1
        if self.backward_passes_per_step == 1:
            rest = list(grads)
        else:  # members whose hook did not run: their sum, with this pass if it has one
            with torch.no_grad():
                rest = [None if overlap.seen(i) else self._add(i, g) if g is not None else self._sums[i]
                        for i, g in enumerate(grads)]
        overlap.finish(rest)
        out = self._collect(passes)
        overlap.done()
        self._sums = [None] * len(self._sums)
        self._passes = 0
        self.last_exchange_s = time.perf_counter() - t0
        return out

    def _exchange(self, sources: list[torch.Tensor | None], passes: int) -> list[torch.Tensor | None]:
        t0 = time.perf_counter()
        fusion = self._fusion
        assert fusion is not None  # set by _prepare
        with torch.no_grad():
            for bucket in fusion.buckets:
                fusion.pack(bucket, [sources[i] for i in bucket.spec.params])
                fusion.launch(bucket)
        out = self._collect(passes)
        self.last_exchange_s = time.perf_counter() - t0
        return out

    def _collect(self, passes: int) -> list[torch.Tensor | None]:
        """Wait for every launched bucket; each tensor's combined gradient (None where no
        rank had one)."""
        fusion = self._fusion
        assert fusion is not None  # set by _prepare
        with torch.no_grad():
            out: list[torch.Tensor | None] = [None] * len(self._sums)
            for bucket in fusion.buckets:
                fusion.wait(bucket)
                unused = set(fusion.unused(bucket))
                for position, index in enumerate(bucket.spec.params):
                    # Views of the flat buffer: Keras applies them before the next step
                    # reuses it. A compressed wire dtype is widened back (a copy).
                    if position not in unused:
                        out[index] = fusion.result(bucket, position)
            if self.average_aggregated_gradients and passes > 1:
                out = [None if g is None else g / passes for g in out]
        return out


def whole_job(process_set: Any, what: str) -> None:
    """Accept Horovod's ``process_set=`` when it names every rank; a ConfigError otherwise."""
    if process_set is None:
        return
    ranks = getattr(process_set, "ranks", None)
    if ranks is None or list(ranks) == list(range(runtime.size())):
        return  # the global process set
    raise ConfigError(
        f"{what}: process_set= over ranks {list(ranks)} is not supported by ringtrain.keras "
        "(Keras' torch backend exchanges over the whole job); leave process_set out, or use "
        "ringtrain.horovod with process sets in a torch training loop"
    )


class _DistributedMixin:
    """Methods added in front of the wrapped Keras optimizer class (see the module doc)."""

    _ringtrain_exchange: GradientExchange
    #: ids of the variables whose gradients stay local (Horovod's ``register_local_var``).
    _ringtrain_local: set[int] = set()
    _ringtrain_scale_local = True

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (not exchanged), as Horovod's; it is divided
        by ``size()`` unless the optimizer was made with ``scale_local_gradients=False``."""
        if not isinstance(var, keras.Variable):
            raise ConfigError(f"register_local_var takes a keras.Variable, got {type(var).__name__}")
        if self._ringtrain_exchange.backward_passes_per_step > 1:
            raise ConfigError(
                "local variables with backward_passes_per_step > 1 are not supported; use "
                "backward_passes_per_step=1, or accumulate in your own train_step"
            )
        object.__setattr__(self, "_ringtrain_local", self._ringtrain_local | {id(var)})

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        if len(grads) == 0:
            return super().apply(grads, trainable_variables)  # type: ignore[misc]
        if trainable_variables is None:
            if not self.built:  # type: ignore[attr-defined]
                return super().apply(grads, trainable_variables)  # type: ignore[misc]  # Keras' error
            variables = list(self._trainable_variables)  # type: ignore[attr-defined]
        else:
            variables = list(trainable_variables)
        local = self._ringtrain_local
        if local:
            return self._apply_partial(list(grads), variables, trainable_variables)
        params = [_torch_value(v) for v in variables]
        # Positional names with the short variable name: stable across ranks even when
        # Keras' auto-generated layer names differ, readable in a mismatch error.
        names = [f"{i}:{getattr(v, 'name', 'variable')}" for i, v in enumerate(variables)]
        reduced = self._ringtrain_exchange.reduce(list(grads), params, names)
        if reduced is None:
            # Accumulating: no update, but the pass counts. Horovod's aggregation helper
            # adds 1 to `iterations` on the passes it does not apply, so a learning-rate
            # schedule, Adam's bias correction and TensorBoard's step see the batch count
            # (counting updates only, a schedule decayed k times slower than Horovod's).
            _pass_counter(self).assign_add(1)
            return None
        return super().apply(reduced, trainable_variables)  # type: ignore[misc]

    def _apply_partial(self, grads: list[Any], variables: list[Any],
                       trainable_variables: Sequence[Any] | None) -> Any:
        """Exchange the shared variables' gradients only; the local ones stay on this rank
        (divided by ``size()`` with ``scale_local_gradients``, Horovod's default)."""
        local = self._ringtrain_local
        shared = [i for i, v in enumerate(variables) if id(v) not in local]
        out = list(grads)
        if shared:
            params = [_torch_value(variables[i]) for i in shared]
            names = [f"{i}:{getattr(variables[i], 'name', 'variable')}" for i in shared]
            reduced = self._ringtrain_exchange.reduce([grads[i] for i in shared], params, names)
            assert reduced is not None  # backward_passes_per_step is 1 (register_local_var)
            for i, g in zip(shared, reduced, strict=True):
                out[i] = g
        if self._ringtrain_scale_local:
            n = float(runtime.size())
            out = [g / n if g is not None and id(variables[i]) in local else g
                   for i, g in enumerate(out)]
        return super().apply(out, trainable_variables)  # type: ignore[misc]

    def apply_accumulated(self) -> None:
        """Exchange and apply gradients accumulated over fewer than
        ``backward_passes_per_step`` passes (e.g. at the end of training); every rank
        must call it. A no-op when nothing is pending.

        ``iterations`` already counts those passes: the update runs at the last pass's
        iteration (as a full accumulation's update does) and leaves the count as it was.
        """
        variables = list(self._trainable_variables)  # type: ignore[attr-defined]
        reduced = self._ringtrain_exchange.flush()
        if reduced is not None:
            counter = _pass_counter(self)
            passes = int(counter.numpy())
            counter.assign(passes - 1)
            super().apply(reduced, variables)  # type: ignore[misc]
            counter.assign(passes)  # also when a loss-scale skip left it alone

    @property
    def backward_passes_per_step(self) -> int:
        return self._ringtrain_exchange.backward_passes_per_step

    @property
    def exchange(self) -> GradientExchange:
        """The gradient exchange (compression, strategy, ``last_exchange_s``)."""
        return self._ringtrain_exchange


def _pass_counter(optimizer: Any) -> Any:
    """The variable behind ``optimizer.iterations``: the innermost optimizer's (a
    ``LossScaleOptimizer`` reports its inner optimizer's count)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return _pass_counter(inner) if inner is not None else optimizer._iterations


def _torch_value(variable: Any) -> torch.Tensor:
    value = getattr(variable, "value", variable)
    if not isinstance(value, torch.Tensor):
        raise ConfigError(
            f"variable {getattr(variable, 'path', variable)!r} is not a torch tensor "
            f"({type(value).__name__}); ringtrain.keras needs the torch backend"
        )
    return value


def _finite_on_every_rank(check_finite: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Keras' ``LossScaleOptimizer.check_finite``, made to agree across ranks when the
    optimizer it wraps is distributed.

    Under the ``mixed_float16`` policy ``compile`` wraps the given optimizer in a
    ``LossScaleOptimizer``, which checks the *local* gradients and calls the inner
    optimizer's ``apply`` (where the exchange is) only when they are finite. A rank
    whose gradients overflowed alone then skipped an exchange the others made: they
    stalled, or, when training went on, paired step t with step t+1 and diverged
    (loss scales halved on one rank only). TensorFlow's wrapper, which Horovod relies
    on, checks gradients already reduced across replicas, so every replica skips the
    same steps; the flag's minimum over ranks gives that decision.
    """

    @functools.wraps(check_finite)
    def check(self: Any, grads: Any) -> Any:
        finite = check_finite(self, grads)
        inner = getattr(self, "inner_optimizer", None)
        if not isinstance(inner, _DistributedMixin):
            return finite
        if inner.exchange.overlap:
            # Backward leaves the *scaled* gradients in .grad and the inner apply gets
            # them divided by the scale: an overlapped exchange never matched, so every
            # step exchanged twice (and a skipped step left its exchanges in flight).
            inner.exchange.stop_overlap()
        if runtime.size() == 1:
            return finite
        flag = torch.tensor([1.0 if bool(finite) else 0.0], device=runtime.device())
        allreduce_(flag, op=Min, name="keras.loss_scale.finite")
        return keras.ops.convert_to_tensor(bool(flag.item() > 0))

    check._ringtrain_agrees = True  # type: ignore[attr-defined]
    return check


_LossScale = keras.optimizers.LossScaleOptimizer
if not getattr(_LossScale.check_finite, "_ringtrain_agrees", False):
    _LossScale.check_finite = _finite_on_every_rank(_LossScale.check_finite)


def _accumulates(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or one it wraps) has Keras' own gradient accumulation, which
    reads ``iterations`` as its pass count too."""
    while optimizer is not None:
        if getattr(optimizer, "gradient_accumulation_steps", None):
            return True
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return False


_CLASSES: dict[type, type] = {}


def _distributed_class(base: type) -> Any:
    cls = _CLASSES.get(base)
    if cls is None:
        # Same name and module as the base, so a saved model records the plain optimizer.
        cls = type(base.__name__, (_DistributedMixin, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__})
        _CLASSES[base] = cls
    return cls


def DistributedOptimizer(  # noqa: N802 - Horovod's name, a factory returning the wrapped class
    optimizer: Any,
    compression: Compressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    fusion_mb: float | None = None,
    strategy: str = "native",
    average_aggregated_gradients: bool = False,
    gradient_predivide_factor: float = 1.0,
    overlap: bool = True,
    *,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    sparse_as_dense: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """Return a copy of the Keras ``optimizer`` that combines gradients across ranks.

    Args:
        optimizer: an unbuilt ``keras.optimizers.Optimizer`` (wrap it before ``fit``).
        compression: ``rt.Compression.none``, ``.fp16`` or ``.bf16`` on the wire.
        backward_passes_per_step: exchange and update every k-th ``apply`` (each
            ``fit`` step is one pass); the k passes' gradients are summed and
            ``iterations`` counts passes, as Horovod's (a learning-rate schedule sees
            the batch count; the update runs at its k-th pass's iteration).
        average_aggregated_gradients: divide that sum by the passes (Horovod's option).
        gradient_predivide_factor: Horovod's split of the average (1/f before the sum,
            f/size after).
        op: ``rt.Average`` (default) or ``rt.Sum`` across ranks.
        fusion_mb: bytes per fused buffer, in MB (default: ``RINGTRAIN_FUSION_MB``, 25).
        strategy: ``"native"``, ``"ring"`` or ``"ps"`` (see ``ringtrain.sync``).
        overlap: start each bucket's exchange during backward, as its gradients become
            ready (from the second step on); False exchanges after backward, for a
            ``train_step`` that changes gradients in place before ``apply``.
        name, device_dense, device_sparse, sparse_as_dense: Horovod's; accepted so its
            scripts run, with nothing to do here (Keras' torch backend hands dense
            gradients, and the exchange runs on the job's device).
        num_groups, groups: Horovod's fusion groups; ringtrain fuses into ``fusion_mb``
            buckets instead (a warning says so).
        process_set: Horovod's; only the global process set (every rank) is supported,
            another raises a ConfigError.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by ``size()`` (Horovod's default).

    Scale the learning rate by ``rt.size()`` yourself (``rt.scale_lr``), as with Horovod.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(
            f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _DistributedMixin):
        raise ConfigError("this optimizer is already a DistributedOptimizer; wrap it once")
    if optimizer.built:
        raise ConfigError(
            "the optimizer is already built (it has state); wrap it in DistributedOptimizer "
            "before model.compile()/fit()"
        )
    whole_job(process_set, "DistributedOptimizer")
    del name, device_dense, device_sparse, sparse_as_dense  # no effect on the torch backend
    if num_groups or groups is not None:
        warnings.warn("num_groups/groups have no effect here: ringtrain fuses gradients into "
                      "buckets of fusion_mb (RINGTRAIN_FUSION_MB)", stacklevel=2)
    exchange = GradientExchange(compression, backward_passes_per_step, op, fusion_mb, strategy,
                                average_aggregated_gradients, gradient_predivide_factor, overlap)
    if backward_passes_per_step > 1 and _accumulates(optimizer):
        raise ConfigError(
            "the optimizer has Keras' own gradient_accumulation_steps and "
            f"backward_passes_per_step={backward_passes_per_step} accumulates too; use one of them "
            "(backward_passes_per_step exchanges once per accumulation)"
        )
    wrapped = _distributed_class(type(optimizer)).from_config(optimizer.get_config())
    # object.__setattr__: Keras' optimizer __setattr__ would try to track the attribute.
    object.__setattr__(wrapped, "_ringtrain_exchange", exchange)
    object.__setattr__(wrapped, "_ringtrain_scale_local", bool(scale_local_gradients))
    return wrapped


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Compressor = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: ReduceOp = Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: Any = None,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """Horovod's ``PartialDistributedOptimizer``: a :func:`DistributedOptimizer` whose
    ``local_layers``' trainable weights keep their gradients on each rank (model-parallel
    parts), divided by ``size()`` unless ``scale_local_gradients=False``; the other
    arguments are :func:`DistributedOptimizer`'s (positional order is Horovod's)."""
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ConfigError("local_layers must be keras.layers.Layer objects (or one of them)")
    unbuilt = [layer.name for layer in local_layers if not layer.built]
    if unbuilt:
        # An unbuilt layer has no weights yet: they would be averaged like the others.
        raise ConfigError(
            f"local layers {unbuilt} are not built (no weights yet); build the model first "
            "(keras.Input, model.build or one call) before PartialDistributedOptimizer"
        )
    wrapped = DistributedOptimizer(
        optimizer, compression, backward_passes_per_step, op,
        average_aggregated_gradients=average_aggregated_gradients,
        gradient_predivide_factor=gradient_predivide_factor, name=name, device_dense=device_dense,
        device_sparse=device_sparse, sparse_as_dense=sparse_as_dense, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped
