"""DistributedOptimizer: wrap any torch optimizer so gradients are averaged across ranks.

How a step flows:

1. ``backward()`` accumulates a parameter's gradient, then its post-accumulate hook
   counts the pass. On the ``backward_passes_per_step``-th pass the parameter is ready.
2. When every parameter of a fusion bucket is ready, the bucket's gradients are packed
   (scaled by 1/(passes*size) for ``Average``) into its flat buffer, reused across steps,
   and an asynchronous allreduce starts while backward goes on. Without compression each
   ``.grad`` becomes a view of that buffer (as DDP's ``gradient_as_bucket_view``), so
   the exchange reduces ``.grad`` in place: read gradients only after ``synchronize()``. Buckets start in plan
   order on every rank, so ranks issue collectives in the same sequence.
3. ``step()`` (or ``synchronize()``) starts the buckets still pending (parameters that
   got no gradient contribute zeros, so no rank waits for an exchange that never
   comes), waits for all, unpacks into ``.grad`` and runs the wrapped optimizer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ringtrain import collectives, events, runtime, sync
from ringtrain.buckets import BucketSpec, plan_buckets
from ringtrain.collectives import Average, ReduceOp, Sum
from ringtrain.compression import Compression, Compressor
from ringtrain.errors import ConfigError

__all__ = ["DistributedOptimizer"]


class _Bucket:
    def __init__(self, spec: BucketSpec, names: list[str], wire: torch.dtype) -> None:
        self.spec = spec
        self.flat = torch.zeros(spec.numel, dtype=wire, device=spec.device)
        # Without compression the gradients can live in the flat buffer itself (as DDP's
        # gradient_as_bucket_view): packing is then at most one copy, unpacking none.
        self.grad_views = wire == spec.dtype
        self.pending = len(spec.params)  # parameters not yet ready in this step
        self.handle: collectives.Handle | None = None
        first, last = names[0], names[-1]
        more = f"..{last}" if len(names) > 1 else ""
        self.name = f"bucket{spec.index}[{first}{more}]"
        self.launched_at = 0.0


class DistributedOptimizer(torch.optim.Optimizer):
    """Averages gradients across ranks with fused, overlapped exchanges, then steps.

    It is a ``torch.optim.Optimizer`` (LR schedulers accept it) that shares
    ``param_groups`` and ``state`` with the wrapped optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        strategy: str | collectives.AllreduceAlgorithm = "native",
        compression: Compressor = Compression.none,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        fusion_mb: float | None = None,
        **strategy_options: Any,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if backward_passes_per_step < 1:
            raise ConfigError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
            )
        if op not in (Average, Sum):
            raise ConfigError(f"DistributedOptimizer supports op=rt.Average or rt.Sum, got {op!r}")
        if not isinstance(compression, Compressor):
            raise ConfigError(
                f"compression must be rt.Compression.none, .fp16 or .bf16, got {compression!r}"
            )
        runtime.world()  # raises NotInitializedError with a hint when rt.init() was not called
        self._inner = optimizer
        # Share the wrapped optimizer's containers so schedulers and checkpoints see one state.
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = {}
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = {}
        self._compression = compression
        self._op = op
        self.backward_passes_per_step = backward_passes_per_step
        self._algorithm = self._resolve_strategy(strategy, strategy_options)
        self.strategy = strategy if isinstance(strategy, str) else type(strategy).__name__

        params, names = self._collect(named_parameters)
        self._params = params
        self._names = names
        mb = fusion_mb if fusion_mb is not None else runtime.settings().fusion_mb
        if mb <= 0:
            raise ConfigError(f"fusion_mb must be > 0, got {mb}")
        specs = plan_buckets(
            [p.shape for p in params], [p.dtype for p in params], [p.device for p in params],
            int(mb * 1024 * 1024),
        )
        self._buckets = [
            _Bucket(s, [names[i] for i in s.params], compression.wire_dtype_for(s.dtype))
            for s in specs
        ]
        self._bucket_of = {i: b for b in self._buckets for i in b.spec.params}
        self._passes = [0] * len(params)
        self._next_launch = 0
        self._synchronized = False
        self._lock = threading.Lock()
        self._layout_checked = False
        #: Seconds ``synchronize`` spent waiting for exchanges not hidden behind backward.
        self.last_exchange_wait_s = 0.0
        #: Seconds the wrapped optimizer's update took in the last ``step``.
        self.last_update_s = 0.0
        #: Called as ``fn(bucket_name, nbytes, t_launch, t_done)`` after each bucket's exchange.
        self.exchange_listeners: list[Callable[[str, int, float, float], None]] = []
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)
        ]

    # -- set-up -------------------------------------------------------------------------

    @staticmethod
    def _resolve_strategy(
        strategy: str | collectives.AllreduceAlgorithm, options: dict[str, Any]
    ) -> str | collectives.AllreduceAlgorithm:
        # HOOK(sync): strategy-specific options (e.g. ps_servers=) are turned into an
        # algorithm object by ringtrain.sync; plain names come from the registry.
        # native/ring/ps become sync strategies: their waits name missing ranks after
        # stall_timeout (an option too); unknown names and options fail with the choices.
        return sync.make_strategy(strategy, **options)

    def _collect(
        self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None
    ) -> tuple[list[torch.nn.Parameter], list[str]]:
        in_groups = [p for g in self._inner.param_groups for p in g["params"] if p.requires_grad]
        if named_parameters is None:
            return in_groups, [f"param{i}" for i in range(len(in_groups))]
        pairs = list(named_parameters)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
            raise ConfigError(
                "named_parameters must yield (name, parameter) pairs: pass model.named_parameters()"
            )
        by_id = {id(p): n for n, p in pairs}
        missing = [i for i, p in enumerate(in_groups) if id(p) not in by_id]
        if missing:
            raise ConfigError(
                f"{len(missing)} parameter(s) of the optimizer are not in named_parameters; "
                "pass the same model's named_parameters() the optimizer was built from"
            )
        return in_groups, [by_id[id(p)] for p in in_groups]

    # -- backward side ------------------------------------------------------------------

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_grad_ready(index)

        return hook

    def _on_grad_ready(self, index: int) -> None:
        with self._lock:
            self._passes[index] += 1
            count = self._passes[index]
            if count > self.backward_passes_per_step:
                raise ConfigError(
                    f"parameter {self._names[index]!r} got {count} backward passes but "
                    f"backward_passes_per_step={self.backward_passes_per_step}; call step() "
                    "after that many passes or raise backward_passes_per_step"
                )
            if count < self.backward_passes_per_step:
                return
            bucket = self._bucket_of[index]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch strictly in plan order so every rank issues the same collective sequence.
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.pending > 0:
                return
            self._launch(bucket)

    def _scale(self, index: int) -> float:
        count = self._passes[index]
        return 1.0 / (count * runtime.size()) if self._op is Average else 1.0

    def _pack(self, bucket: _Bucket) -> None:
        if bucket.grad_views:
            self._pack_in_place(bucket)
            return
        with torch.no_grad():
            for index, offset in zip(bucket.spec.params, bucket.spec.offsets):
                p = self._params[index]
                view = bucket.flat[offset : offset + p.numel()]
                if p.grad is None or self._passes[index] == 0:
                    view.zero_()  # unused parameter: contribute zeros, never skip the exchange
                    continue
                grad = p.grad.detach().reshape(-1)
                scale = self._scale(index)
                if scale == 1.0:
                    view.copy_(grad)
                elif view.dtype == grad.dtype:
                    torch.mul(grad, scale, out=view)
                else:
                    view.copy_(grad * scale)  # scale before narrowing: fp16 overflows at 65504

    def _pack_in_place(self, bucket: _Bucket) -> None:
        # Make every .grad a view of the flat buffer. A gradient that already is one (the
        # user zeroed instead of setting to None) was accumulated in place: no copy at all.
        # The exchange then reduces .grad directly and unpacking has nothing to do.
        scales: set[float] = set()
        with torch.no_grad():
            for index, offset in zip(bucket.spec.params, bucket.spec.offsets):
                p = self._params[index]
                view = bucket.flat[offset : offset + p.numel()]
                grad = p.grad
                if grad is None or self._passes[index] == 0:
                    view.zero_()  # unused parameter: contribute zeros, never skip the exchange
                elif grad.data_ptr() != view.data_ptr() or not grad.is_contiguous():
                    view.copy_(grad.detach().reshape(-1))
                p.grad = view.view(p.shape)
                if self._passes[index]:
                    scales.add(self._scale(index))
            if not scales or scales == {1.0}:
                return
            if len(scales) == 1:
                bucket.flat.mul_(scales.pop())  # one pass over the buffer, the common case
                return
            for index, offset in zip(bucket.spec.params, bucket.spec.offsets):
                if self._passes[index]:
                    bucket.flat[offset : offset + self._params[index].numel()].mul_(
                        self._scale(index))

    def _launch(self, bucket: _Bucket) -> None:
        if not self._layout_checked:
            self._layout_checked = True
            # HOOK(sync): compare the exchange signature across ranks before the first launch.
            sync.check_exchange(
                self._algorithm,
                [(self._names[i], self._params[i].shape, self._params[i].dtype)
                 for b in self._buckets for i in b.spec.params],
                {"op": self._op.name, "compression": repr(self._compression),
                 "buckets": " ".join(str(b.spec.numel) for b in self._buckets),
                 "backward_passes_per_step": str(self.backward_passes_per_step)},
            )
        self._pack(bucket)
        bucket.launched_at = time.perf_counter()
        bucket.handle = collectives.allreduce_async_(
            bucket.flat, Sum, bucket.name, algorithm=self._algorithm
        )
        self._next_launch += 1

    # -- step side ----------------------------------------------------------------------

    def synchronize(self) -> None:
        """Finish this step's gradient exchange and write the averaged gradients to ``.grad``."""
        if self._synchronized:
            return
        t0 = time.perf_counter()
        with self._lock:
            for bucket in self._buckets:
                bucket.pending = 0
            self._launch_ready()
        for bucket in self._buckets:
            assert bucket.handle is not None
            # HOOK(sync): stall inspection wraps this wait.
            bucket.handle.wait()
            t_done = time.perf_counter()
            nbytes = bucket.flat.numel() * bucket.flat.element_size()
            for fn in self.exchange_listeners:
                fn(bucket.name, nbytes, bucket.launched_at, t_done)
            if events.active():
                names = [self._names[i] for i in bucket.spec.params]
                events.emit("exchange", bucket.launched_at, t_done, name=bucket.name,
                            bytes=nbytes, tensors=names)
            self._unpack(bucket)
        t_end = time.perf_counter()
        self.last_exchange_wait_s = t_end - t0
        if events.active():
            events.emit("exchange_wait", t0, t_end)
        self._synchronized = True

    def _unpack(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            for index, offset in zip(bucket.spec.params, bucket.spec.offsets):
                p = self._params[index]
                view = bucket.flat[offset : offset + p.numel()].view(p.shape)
                if bucket.grad_views and p.grad is not None and p.grad.data_ptr() == view.data_ptr():
                    continue  # the exchange reduced .grad itself
                if p.grad is None:
                    p.grad = view.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(view)

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.pending = len(bucket.spec.params)
            bucket.handle = None
        self._passes = [0] * len(self._params)
        self._next_launch = 0
        self._synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Run ``step()`` without exchanging again (after an explicit ``synchronize()``)."""
        if not self._synchronized:
            raise ConfigError(
                "skip_synchronize() without synchronize(): call opt.synchronize() first, "
                "then clip, then 'with opt.skip_synchronize(): opt.step()'"
            )
        yield

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        self.synchronize()
        t0 = time.perf_counter()
        try:
            return self._inner.step(closure) if closure is not None else self._inner.step()
        finally:
            t_end = time.perf_counter()
            self.last_update_s = t_end - t0
            if events.active():
                events.emit("update", t0, t_end)
                events.emit("step_end", t_end, t_end)
            self._reset()

    # -- delegation ---------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError(
            "add_param_group on a DistributedOptimizer is not supported: add the group to the "
            "wrapped optimizer before wrapping it"
        )

    @property
    def wrapped(self) -> torch.optim.Optimizer:
        return self._inner

    @property
    def bucket_names(self) -> list[str]:
        return [b.name for b in self._buckets]

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({type(self._inner).__name__}, strategy={self.strategy!r}, "
            f"buckets={len(self._buckets)}, compression={self._compression!r})"
        )
