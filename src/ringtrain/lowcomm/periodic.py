"""The engine under ``rt.LocalSGD`` and ``rt.DiLoCo``: local steps, and every
``sync_every``-th step an exchange of how far each rank moved.

Every ``step()`` runs the local (inner) optimizer on this rank's gradients alone; no
gradient leaves the rank. Every ``sync_every``-th step (per fragment, see
:mod:`.fragments`) each rank computes its *outer gradient*, the synced copy of the
parameters (what every rank held after the last sync) minus its parameters now, and
the ranks average it through :class:`ringtrain.fusion.FusedExchange`, the same fused
buckets, strategies (``native``/``ring``/``ps``) and ``rt.Compression`` as
``DistributedOptimizer``. All buckets are launched before the first is waited for, so
packing the later ones overlaps the exchange of the earlier ones (the exchange runs on
the strategy's thread or in the backend). What each mode does with the average
is its own (:meth:`PeriodicSync._apply`): LocalSGD sets the parameters to the synced
copy minus it (the average of the ranks' parameters), DiLoCo hands it to its outer
optimizer.

Every rank starts the sync from the same synced copy and receives the same averaged
bytes (each strategy computes each sum once and sends it to all), and the update is
deterministic, so ranks hold bit-identical parameters after every sync. The synced copy
is taken at the first ``step()``, after every rank has taken rank 0's parameters (as
DDP's constructor does), so a script that forgets ``rt.broadcast_parameters`` still
trains one model.

Costs: one copy of the synced parameters, the fused buffers (the size of the
synced parameters on the wire), and for DiLoCo the outer optimizer's state.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from ringtrain import claims, collectives, events, replicate, runtime, sync
from ringtrain.agreement.signature import strategy_settings
from ringtrain.collectives import Average, Handle, Max
from ringtrain.compression import Compression, Compressor
from ringtrain.errors import ConfigError, MismatchError, OptimizerUsageError
from ringtrain.fusion import Bucket, FusedExchange
from ringtrain.lowcomm import checks, fragments
from ringtrain.lowcomm.warmup import average_gradients
from ringtrain.optimizer import owner_of

__all__ = ["PeriodicSync"]


class PeriodicSync(torch.optim.Optimizer):
    """Base of the periodic modes; see the module doc. Subclasses set :attr:`mode` and
    implement :meth:`_apply` (and may extend the state and the agreement).

    A ``torch.optim.Optimizer`` (as torch's ``PostLocalSGDOptimizer``), so everything
    that takes an optimizer takes it: every learning-rate scheduler, ``GradScaler``,
    ``opt.param_groups[0]["lr"] = x``. Its ``param_groups``, ``state`` and ``defaults``
    are the local (inner) optimizer's own objects, so a scheduler on the wrapper
    schedules the inner optimizer. ``Optimizer.__init__`` is not called: the wrapper
    holds no parameters or state of its own.
    """

    mode: ClassVar[str] = ""
    #: torch.amp.GradScaler calls step() even when this rank's gradients overflowed
    #: (setting ``found_inf`` and ``grad_scale``), instead of skipping it: a skipped call
    #: would leave this rank's step count, and so its syncs, behind the other ranks'.
    _step_supports_amp_scaling: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        synced: list[torch.nn.Parameter],
        *,
        sync_every: int,
        fragments_: int,
        compression: Compressor | None,
        strategy: str | collectives.AllreduceAlgorithm,
        fusion_mb: float | None,
        buffers: bool,
        argument: str,
        strategy_options: dict[str, Any],
        warmup_steps: int = 0,
    ) -> None:
        mode = self.mode
        self.sync_every = checks.check_count(mode, "sync_every", sync_every)
        #: Steps whose gradients are averaged over the ranks (as DDP) before the local
        #: steps start (post-local SGD's warm-up; :mod:`.warmup`).
        self.warmup_steps = checks.check_count(mode, "warmup_steps", warmup_steps, minimum=0)
        self.fragments = checks.check_count(mode, "fragments", fragments_)
        if self.fragments > self.sync_every:
            raise ConfigError(f"rt.{mode}: fragments={fragments_} is more than sync_every={sync_every}; "
                              "each fragment syncs once per interval, at its own step")
        if compression is None:
            compression = Compression.none
        if not isinstance(compression, Compressor):
            raise ConfigError(f"rt.{mode}: compression must be rt.Compression.none, .fp16 or .bf16, "
                              f"got {compression!r}")
        runtime.world()  # NotInitializedError with a hint when rt.init() was not called
        names = {id(p): n for n, p in model.named_parameters()}
        if not synced:
            raise ConfigError(f"rt.{mode}: the model has no parameters to train")
        held = [names[id(p)] for p in synced if owner_of(p) is not None]
        if held:
            raise ConfigError(
                f"rt.{mode}: {len(held)} of the model's parameters (first {held[0]!r}) are held by a "
                f"live DistributedOptimizer, which exchanges their gradients after every backward. "
                f"Use one exchange mode per parameter: pass the plain torch optimizer to rt.{mode} "
                "and drop the DistributedOptimizer (del it) first")
        self._inner = optimizer
        self._model = model
        self._params = list(synced)
        self._names = [names[id(p)] for p in synced]
        # The model's parameters left out because they were frozen: one that trains later
        # would move on each rank's data alone, never averaged (step() refuses it).
        in_sync = {id(p) for p in synced}
        self._left_out = [(n, p) for n, p in model.named_parameters() if id(p) not in in_sync]
        self._compression = compression
        self._strategy = sync.make_strategy(strategy, **strategy_options)
        self.strategy = strategy if isinstance(strategy, str) else type(strategy).__name__
        self._argument = argument
        mb = fusion_mb if fusion_mb is not None else runtime.settings().fusion_mb
        if not mb > 0:
            raise ConfigError(f"rt.{mode}: fusion_mb must be > 0, got {mb}")
        self._bucket_bytes = int(mb * 1024 * 1024)
        self._parts = fragments.split([p.numel() for p in synced], self.fragments)
        label = mode.lower()
        # With a warm-up the buckets also carry which parameters had a gradient on any
        # rank (one element each): one no rank used keeps no gradient, as under DDP.
        self._exchanges = [
            FusedExchange([self._names[i] for i in part], [synced[i] for i in part], self._strategy,
                          compression, Average, runtime.size(), self._bucket_bytes,
                          label=f"{label}{f}.", track_use=self.warmup_steps > 0)
            for f, part in enumerate(self._parts)
        ]
        #: Every float buffer of the model: each rank's own between syncs (and always with
        #: buffers=False), so local_state_dict saves them per rank.
        self._float_buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        self._buffers = list(self._float_buffers) if buffers else []
        self._buffer_exchange = FusedExchange(
            [n for n, _ in self._buffers], [b for _, b in self._buffers], self._strategy, Compression.none,
            Average, runtime.size(), self._bucket_bytes, label=f"{label}.buffers.") if self._buffers else None
        #: The parameters every rank held after the last sync (None until the first step).
        self._copy: list[torch.Tensor] | None = None
        self._agreed = False
        #: Whether every rank held the same parameters at the first step (then nothing was
        #: broadcast: the agreement compared their digests).
        self.same_start = False
        #: Steps taken (the schedule counts them; saved and restored with the state).
        self.steps = 0
        #: Fragments synced since the last step (equal on every rank: a function of the
        #: schedule and of sync() calls). sync() gives them no second outer step.
        self._clean: set[int] = set()
        #: Syncs done in this process, and the bytes handed to the exchange for them.
        self.syncs = 0
        self.exchanged_bytes = 0
        #: Seconds the last sync took (exchange, write-back and outer step).
        self.last_sync_s = 0.0
        #: How many parameters the local optimizer held at the last check (a group added
        #: to it directly is checked at the next step).
        self._inner_count = self._count_inner()
        # torch.optim.Optimizer's per-instance hook registries, which its __init__ (not
        # called: the groups and state are the local optimizer's) would create; without
        # them opt.register_step_post_hook(...) etc. raised AttributeError. They run
        # around this wrapper's step() and state_dict(), with the wrapper as the
        # optimizer; the global hooks run once per step, with the local optimizer's.
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        claims.claim(self._params, self)

    # -- the optimizer surface ----------------------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        """The local optimizer's groups (clipping, GradScaler, schedulers and learning
        rates act here). Read each time: ``load_state_dict`` replaces the inner list."""
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The local optimizer's per-parameter state."""
        return self._inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self._inner.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        """The local optimizer's defaults (OneCycleLR looks for ``momentum``/``betas`` here)."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self._inner.defaults = defaults

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer that steps locally (schedule its learning rate directly)."""
        return self._inner

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the local optimizer (as ``PostLocalSGDOptimizer``), when every
        tensor in it is a parameter of the model (a part the local optimizer did not hold
        yet); any other tensor would train on each rank's data alone, never averaged."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        self._check_synced(params, "add_param_group")
        self._inner.add_param_group(param_group)
        self._inner_count = self._count_inner()

    def _count_inner(self) -> int:
        return sum(len(g["params"]) for g in self._inner.param_groups)

    def _check_synced(self, params: list[Any], where: str) -> None:
        """Every parameter of the local optimizer is the model's: the synced ones, or
        those frozen when the mode was built (step() refuses one that trains later)."""
        model = {id(p) for p in self._model.parameters()}
        stray = next((p for p in params if id(p) not in model), None)
        if stray is not None:
            raise OptimizerUsageError(
                f"rt.{self.mode}.{where}: the local optimizer holds a tensor of shape "
                f"{tuple(stray.shape)} that is not one of the model's parameters, so rt.{self.mode} "
                "never averages it: it would train on each rank's data alone and the replicas would "
                f"drift apart. Register it in the model (an nn.Parameter of a module) and build "
                f"rt.{self.mode} again, or keep it out of the optimizer")

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """The local step; after every ``sync_every``-th, the sync (collective). During
        the first ``warmup_steps`` steps the gradients are averaged before the step.
        Hooks registered on this wrapper (``register_step_pre_hook``/``_post_hook``) run
        before and after all of it, as torch runs them around an optimizer's step()."""
        if not self._optimizer_step_pre_hooks and not self._optimizer_step_post_hooks:
            return self._step(closure)
        args: tuple[Any, ...] = (self,) if closure is None else (self, closure)
        kwargs: dict[str, Any] = {}
        for pre_hook in list(self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"a step pre-hook of rt.{self.mode} must return None or a tuple "
                                       f"(new_args, new_kwargs), got {result!r}")
                args, kwargs = result
        out = self._step(*args[1:], **kwargs)
        for post_hook in list(self._optimizer_step_post_hooks.values()):
            post_hook(self, args, kwargs)
        return out

    def _step(self, closure: Callable[[], float] | None = None) -> Any:
        self._check_live()
        if self._count_inner() != self._inner_count:  # a group added to the inner optimizer
            self._check_synced([p for g in self._inner.param_groups for p in g["params"]], "step")
            self._inner_count = self._count_inner()
        if not self._agreed:
            self._agree()
        if self._copy is None:
            self._take_start()
        for name, p in self._left_out:
            if p.requires_grad and p.grad is not None:
                raise OptimizerUsageError(
                    f"rt.{self.mode}: parameter {name!r} was frozen when rt.{self.mode} was built and "
                    "has a gradient now; it is not synced, so each rank would train it on its own "
                    f"data and the replicas would drift apart. After a sync, del this rt.{self.mode} "
                    "and build it again with the parameter unfrozen (or build it with every parameter "
                    "that will train requiring a gradient)")
        if self.steps < self.warmup_steps:
            return self._warmup_step(closure)
        due = self._due(self.steps + 1)
        # The step-count check of this step's sync goes out before the local update, so
        # its round trip (one on a slow link) overlaps the update instead of adding to
        # the sync.
        check = self._launch_step_check(self.steps + 1) if due else None
        t0 = time.perf_counter()
        result = None
        try:
            if self._scaled_step_ok():
                result = self._inner.step(closure) if closure is not None else self._inner.step()
        finally:
            if events.active():
                events.emit("update", t0, time.perf_counter())
        # Counted even when GradScaler skipped the local update: the schedule is the
        # same on every rank, whichever rank's gradients overflowed.
        self.steps += 1
        self._clean.clear()
        for f in due:
            self._sync(f, check)
            check = None  # one check covers every fragment of the step
            self._clean.add(f)
        if events.active():
            now = time.perf_counter()
            events.emit("step_end", now, now)
        events.check_stop()  # the doctor has its steps: leave here, nothing in flight
        return result

    def _due(self, step: int) -> list[int]:
        """The fragments that sync after the ``step``-th step (from 1): the schedule
        starts after the warm-up."""
        return fragments.due(step - self.warmup_steps, self.sync_every, self.fragments)

    def _warmup_step(self, closure: Callable[[], float] | None) -> Any:
        """A warm-up step: every rank's gradients averaged, then the local step (the
        same on every rank, so the parameters stay equal). A closure averages the
        gradients of each of its backward passes, as DDP's hooks do. Under GradScaler a
        rank unscales its own gradients first (each rank keeps its own loss scale); an
        overflow on any rank makes the average non-finite on every rank, and every rank
        skips the step."""
        check = self._launch_step_check(self.steps + 1)
        scaled = getattr(self, "found_inf", None) is not None
        ok = self._scaled_step_ok()
        t0 = time.perf_counter()
        result = None
        if closure is not None:
            def averaged() -> float:
                with torch.enable_grad():
                    loss = closure()
                self._average_grads()
                return loss
            result = self._inner.step(averaged)
        else:
            self._average_grads()
            if scaled:
                ok = all(bool(torch.isfinite(p.grad).all()) for p in self._params if p.grad is not None)
            if ok:
                result = self._inner.step()
        self._check_steps(check)
        if events.active():
            events.emit("update", t0, time.perf_counter())
        self.steps += 1
        if self.steps == self.warmup_steps:
            # The local steps start here, from parameters that are the same on every rank.
            with torch.no_grad():
                self._copy = [p.detach().clone() for p in self._params]
        self._clean = set(range(self.fragments))
        if events.active():
            now = time.perf_counter()
            events.emit("step_end", now, now)
        events.check_stop()
        return result

    def _average_grads(self) -> None:
        if runtime.size() > 1:
            t0 = time.perf_counter()
            average_gradients(self.mode, self._exchanges, self._parts, self._params, self._wait)
            if events.active():
                # The step meter's exchange wait, as DistributedOptimizer's; the update
                # span around the warm-up step leaves it to this phase (meter's order).
                events.emit("exchange_wait", t0, time.perf_counter())

    def sync(self) -> None:
        """Sync every fragment now, outside the schedule (collective: every rank calls it
        at the same point), e.g. at the end of training, so every rank holds one model."""
        self._check_live()
        if not self._agreed:
            self._agree()
        if self._copy is None:
            self._take_start()
        check = self._launch_step_check(self.steps)
        for f in range(self.fragments):
            # A fragment synced at this step already holds the synced copy on every rank:
            # it is averaged again (buffers included) but takes no second outer step.
            self._sync(f, check, outer=f not in self._clean)
            check = None
        self._clean = set(range(self.fragments))

    def _scaled_step_ok(self) -> bool:
        """Under ``GradScaler.step(opt)`` (see ``_step_supports_amp_scaling``): False when
        this rank's gradients overflowed (the local update is skipped, as the scaler would
        skip it), else unscale them when the scaler has not and return True. True when
        no scaler called."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return True
        if float(found_inf) != 0.0:
            return False
        scale = getattr(self, "grad_scale", None)
        if scale is not None:  # not unscaled by scaler.unscale_(opt): do it as it would
            inv = scale.double().reciprocal().float()
            with torch.no_grad():
                for group in self._inner.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inv.to(p.grad.device))
        return True

    @property
    def synced_copy(self) -> list[torch.Tensor] | None:
        """The parameters of the last sync (in the model's order); None before the first step."""
        return self._copy

    # -- start and agreement ------------------------------------------------------------

    def _settings(self) -> dict[str, str]:
        """What every rank must pass alike (compared at the first step)."""
        strategy = strategy_settings(self._strategy)
        return {
            "sync_every": str(self.sync_every), "fragments": str(self.fragments),
            "compression": self._compression.name, "strategy": " ".join(f"{k}={v}" for k, v in sorted(strategy.items())),
            "buffers": " ".join(n for n, _ in self._buffers) or "none",
            "fusion_mb": str(self._bucket_bytes), "warmup_steps": str(self.warmup_steps),
        }

    def _agree(self) -> None:
        entries = [(n, tuple(p.shape), str(p.dtype).replace("torch.", "")) for n, p in
                   zip(self._names, self._params, strict=True)]
        start = "" if self._copy is not None else checks.digest(
            [*self._params, *(b for _, b in self._buffers)])
        self.same_start = len(set(checks.agree(self.mode, entries, self._settings(), start))) == 1
        self._agreed = True

    def _take_start(self) -> None:
        """Every rank takes rank 0's parameters (and float buffers), unless every rank
        already holds the same bytes (the first-step agreement compared their digests);
        they become the synced copy."""
        if runtime.size() > 1 and not self.same_start:
            replicate.broadcast_tensors_([*self._params, *(b for _, b in self._buffers)], 0,
                                         name=f"rt.{self.mode} start")
        with torch.no_grad():
            self._copy = [p.detach().clone() for p in self._params]
        self._clean = set(range(self.fragments))

    # -- the sync -----------------------------------------------------------------------

    def _sync(self, f: int, check: tuple[torch.Tensor, Handle] | None, outer: bool = True) -> None:
        """Average fragment ``f``'s outer gradient over the ranks and apply it (``outer``
        False: as the average of the ranks' parameters, with no outer step)."""
        assert self._copy is not None
        ex = self._exchanges[f]
        part = self._parts[f]
        t0 = time.perf_counter()
        for bucket in ex.buckets:
            ex.pack(bucket, self._outer_gradients(ex, bucket, part))
            ex.launch(bucket)
        extra = self._buffer_exchange if f == 0 else None
        if extra is not None:
            for bucket in extra.buckets:
                extra.pack(bucket, [b for _, b in (self._buffers[i] for i in bucket.spec.params)])
                extra.launch(bucket)
        averaged: dict[int, torch.Tensor] = {}
        for bucket in ex.buckets:
            self._wait(ex, bucket)
            for position, local in enumerate(bucket.spec.params):
                averaged[part[local]] = ex.result(bucket, position)
        if extra is not None:
            with torch.no_grad():
                for bucket in extra.buckets:
                    self._wait(extra, bucket)
                    for position, index in enumerate(bucket.spec.params):
                        self._buffers[index][1].copy_(extra.result(bucket, position))
        t_wait = time.perf_counter()
        if events.active():
            events.emit("exchange_wait", t0, t_wait)
        self._check_steps(check)
        self._check_finite(part, averaged)
        self._apply(part, averaged, outer)
        with torch.no_grad():
            for i in part:
                self._copy[i].copy_(self._params[i])
        t_end = time.perf_counter()
        if events.active():
            events.emit("update", t_wait, t_end)
        self.last_sync_s = t_end - t0
        self.syncs += 1

    def _launch_step_check(self, steps: int) -> tuple[torch.Tensor, Handle] | None:
        """Start the exchange of the step count ``steps`` a sync is at (the max of
        ``[steps, -steps]``: the highest and the lowest of any rank; 16 bytes); None alone."""
        if runtime.size() == 1:
            return None
        counts = torch.tensor([steps, -steps], dtype=torch.int64, device=self._params[0].device)
        return counts, self._strategy(counts, Max, f"rt.{self.mode} step check")

    def _check_steps(self, launched: tuple[torch.Tensor, Handle] | None) -> None:
        """Every rank must reach a sync after the same number of steps. A rank that
        stepped more or fewer times (uneven batches per rank, a skipped or an extra
        step, sync() called on some ranks only) pairs its exchange with another round of
        the others: the average would silently mix rounds, and the job would hang or
        stall at its end. Every rank of the exchange holds the same extremes, so every
        one raises the same error, after the exchange (none is left waiting), before the
        parameters change."""
        if launched is None:
            return
        counts, handle = launched
        handle.wait()
        high, low = int(counts[0]), -int(counts[1])
        if high != low:
            raise MismatchError(
                f"rt.{self.mode}: the ranks reached this sync after different numbers of steps "
                f"(from {low} to {high}; this rank: {self.steps}), so it would average different "
                "rounds. The parameters were left as they were. Every rank must call step() "
                "equally often (the same number of batches per rank: rt.data.Loader or "
                "DistributedSampler) and sync() on every rank at the same step")

    def _outer_gradients(self, ex: FusedExchange, bucket: Bucket, part: list[int]) -> list[torch.Tensor]:
        """Synced copy minus parameters, for the bucket's members; written straight into
        the bucket (then only scaled) when it travels uncompressed."""
        assert self._copy is not None
        out = []
        with torch.no_grad():
            for position, local in enumerate(bucket.spec.params):
                i = part[local]
                start = self._copy[i].reshape(-1)
                now = self._params[i].detach().reshape(-1)
                if bucket.grad_views:
                    view = bucket.view(position)
                    torch.sub(start, now, out=view)
                    out.append(view)
                else:
                    out.append(start - now)
        return out

    def _wait(self, ex: FusedExchange, bucket: Bucket) -> None:
        ex.wait(bucket)
        self.exchanged_bytes += bucket.nbytes
        if events.active():
            names = [ex.names[i] for i in bucket.spec.params]
            events.emit("exchange", bucket.launched_at, time.perf_counter(), name=bucket.name,
                        bytes=bucket.nbytes, tensors=names)

    def _check_finite(self, part: list[int], averaged: dict[int, torch.Tensor]) -> None:
        """fp16 on the wire overflows silently above 65504: refuse a non-finite average
        before it reaches the parameters. Every rank holds the same average, so every
        rank raises the same error, after the exchange (no rank is left waiting)."""
        if self._compression.wire_dtype is not torch.float16:
            return
        for i in part:
            if not bool(torch.isfinite(averaged[i]).all()):
                raise ConfigError(
                    f"rt.{self.mode}: the averaged change of {self._names[i]!r} since the last "
                    "sync is not finite with compression=rt.Compression.fp16: a change larger than "
                    "about 65504 overflows float16 on the wire (or a rank's parameters are not "
                    "finite). The parameters were left as they were; use compression="
                    "rt.Compression.bf16 (float32's range) or none")

    def _apply(self, part: list[int], averaged: dict[int, torch.Tensor], outer: bool = True) -> None:
        """Set the parameters ``part`` (indices into the synced list) from their averaged
        outer gradients (``averaged[i]``, flat, in the parameter's dtype); ``outer``
        False: no outer step, the parameters become the average."""
        raise NotImplementedError

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The synced copy, the step count and the local optimizer's state (this rank's);
        DiLoCo adds its outer optimizer's. Tensors are references, not copies. The
        wrapper's state-dict hooks run around it, as torch's."""
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        state = self._state()
        for post_hook in list(self._optimizer_state_dict_post_hooks.values()):
            changed = post_hook(self, state)
            if changed is not None:
                state = changed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            changed = pre_hook(self, state)
            if changed is not None:
                state = changed
        self._load_state(state)
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)

    def _state(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "sync_every": self.sync_every, "fragments": self.fragments,
            "steps": self.steps,
            "synced": None if self._copy is None else dict(zip(self._names, self._copy, strict=True)),
            "inner": self._inner.state_dict(),
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("mode") != self.mode:
            found = state.get("mode") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"rt.{self.mode}.load_state_dict: this state is not an rt.{self.mode} "
                              f"state (mode {found!r})")
        copy = state.get("synced")
        if copy is not None:
            missing = [n for n in self._names if n not in copy]
            if missing:
                raise ConfigError(f"rt.{self.mode}.load_state_dict: the saved synced copy has no "
                                  f"{missing[0]!r}: it was saved from another model")
            wrong = [n for n, p in zip(self._names, self._params, strict=True)
                     if tuple(copy[n].shape) != tuple(p.shape)]
            if wrong:
                raise ConfigError(f"rt.{self.mode}.load_state_dict: {wrong[0]!r} has shape "
                                  f"{tuple(copy[wrong[0]].shape)} in the state but "
                                  f"{tuple(self._params[self._names.index(wrong[0])].shape)} in the model")
            with torch.no_grad():
                self._copy = [copy[n].detach().to(p.device, p.dtype).clone()
                              for n, p in zip(self._names, self._params, strict=True)]
        else:
            self._copy = None
        self.steps = int(state["steps"])
        # Saved at a step where fragments synced: those held the synced copy.
        self._clean = set(range(self.fragments)) if self.steps <= self.warmup_steps \
            else set(self._due(self.steps))
        self._inner.load_state_dict(state["inner"])
        self._inner_count = self._count_inner()

    # -- per-rank state and resizing (used by rt.elastic and hvd.elastic) ----------------

    def local_state_dict(self) -> dict[str, Any]:
        """What only this rank has: its parameters (when they differ from the synced copy,
        i.e. between syncs) and its local optimizer's state. ``rt.elastic.Resumable``
        saves it for every rank, so a resume at any step is exact on every rank."""
        # At a sync every rank holds the synced copy (and the averaged buffers). The end
        # of a warm-up is not one: its buffers are still each rank's own.
        at_sync = self.fragments == 1 and (self.steps == 0 or (
            self.steps > self.warmup_steps and (self.steps - self.warmup_steps) % self.sync_every == 0))
        averaged = {n for n, _ in self._buffers} if at_sync else set()
        return {
            "params": None if at_sync or self._copy is None else [p.detach().clone() for p in self._params],
            "inner": self._inner.state_dict(),
            # Float buffers (BatchNorm statistics) are each rank's own until they are
            # averaged with fragment 0 (and always with buffers=False).
            "buffers": {n: b.detach().clone() for n, b in self._float_buffers if n not in averaged},
        }

    def load_local_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`local_state_dict`; None (saved by another world size): the
        parameters go back to the synced copy (this rank's local steps are lost)."""
        with torch.no_grad():
            if state is None or state.get("params") is None:
                if self._copy is not None:
                    for p, c in zip(self._params, self._copy, strict=True):
                        p.copy_(c)
            else:
                for p, saved in zip(self._params, state["params"], strict=True):
                    p.copy_(saved)
            if state is not None:
                mine = state.get("buffers") or {}  # absent from states saved before
                for n, b in self._float_buffers:
                    if n in mine:
                        b.copy_(mine[n])
        if state is not None:
            self._inner.load_state_dict(state["inner"])

    def world_changed(self) -> bool:
        """The job moved to a world of another size (``rt.elastic``, ``hvd.elastic``):
        every rank takes rank 0's synced copy, step count (and DiLoCo's outer state); a
        rank that had not stepped (one that just joined) starts from the synced copy,
        the others keep their local steps, so a rank lost mid-interval costs only its
        own. Collective. Returns True: the model is consistent, the caller must not
        broadcast rank 0's parameters over the other ranks' local ones."""
        n = runtime.size()
        for ex in self._exchanges:
            ex.size = n
        if self._buffer_exchange is not None:
            self._buffer_exchange.size = n
        self._agreed = False
        self._clean = set()  # the same on every rank, the one that joined included
        if n == 1:
            return True
        fresh = self._copy is None
        # The local optimizer's hyperparameters too (its state stays each rank's own): a
        # rank that just joined built its groups afresh, and a scheduler loaded with rank
        # 0's state (TorchState, Resumable) does not set the rates in them, so it went on
        # from the initial learning rate while the others used the scheduled one.
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self._inner.param_groups]
        root = collectives.broadcast_object(
            {"started": not fresh, "steps": self.steps, "groups": groups} if runtime.rank() == 0 else None,
            0, name=f"rt.{self.mode} world change")
        self._take_groups(root["groups"])
        if not root["started"]:
            self._copy = None  # the first step takes rank 0's parameters
            self.steps = 0
        else:
            if fresh:
                self._copy = [p.detach().clone() for p in self._params]
            assert self._copy is not None
            buffers = [b.detach().clone() for _, b in self._buffers]
            replicate.broadcast_tensors_([*self._copy, *buffers], 0, name=f"rt.{self.mode} synced copy")
            if fresh:
                with torch.no_grad():
                    for p, c in zip(self._params, self._copy, strict=True):
                        p.copy_(c)
                    for (_, b), got in zip(self._buffers, buffers, strict=True):
                        b.copy_(got)
            self.steps = int(root["steps"])
        self._world_changed_extra()
        return True

    def _take_groups(self, groups: list[dict[str, Any]]) -> None:
        """Set the local optimizer's hyperparameters to ``groups`` (rank 0's, group by group)."""
        mine = self._inner.param_groups
        if len(groups) != len(mine):
            raise MismatchError(
                f"rt.{self.mode}.world_changed: rank 0's local optimizer has {len(groups)} parameter "
                f"group(s), this rank's {len(mine)}: build the optimizer the same way on every rank")
        with torch.no_grad():
            for group, root in zip(mine, groups, strict=True):
                for key, value in root.items():
                    here = group.get(key)
                    if isinstance(here, torch.Tensor) and isinstance(value, torch.Tensor):
                        here.copy_(value)  # a tensor learning rate (capturable): in place
                    else:
                        group[key] = value

    def _world_changed_extra(self) -> None:
        """Subclasses' own part of :meth:`world_changed` (collective)."""

    # -- misc ---------------------------------------------------------------------------

    def _check_live(self) -> None:
        if claims.holder(self._params[0]) is not self:
            raise ConfigError(f"this rt.{self.mode} was replaced: a newer one holds the same "
                              "parameters, and only the newest syncs them; step the new one")

    def named_synced(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The parameters this mode syncs, with their names, in sync order."""
        return iter(zip(self._names, self._params, strict=True))

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"an rt.{self.mode} cannot be pickled; save opt.state_dict() instead")

    def __repr__(self) -> str:
        buckets = sum(len(ex.buckets) for ex in self._exchanges)
        return (f"{self.mode}({type(self._inner).__name__}, sync_every={self.sync_every}, "
                f"fragments={self.fragments}, strategy={self.strategy!r}, buckets={buckets}, "
                f"compression={self._compression!r})")
