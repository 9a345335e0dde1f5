"""Horovod's Keras callbacks on ringtrain: same start, same logs, gradual warmup.

- :class:`BroadcastGlobalVariablesCallback` gives every rank rank 0's model and
  optimizer variables when training begins (step 4 of the article's six).
- :class:`MetricAverageCallback` averages the epoch's metrics over ranks, so every
  rank logs, checkpoints and early-stops on the same numbers.
- :class:`LearningRateWarmupCallback` ramps the learning rate from the single-worker
  rate to the scaled one over the first epochs (Goyal et al. 2017, section 2.2).
- :class:`LearningRateScheduleCallback` sets ``initial_lr * multiplier(epoch)`` over a
  range of epochs (Horovod's piecewise schedules).
- :class:`BestModelCheckpoint` saves the model on rank 0 whenever the monitored metric
  improves.

Put them first in ``callbacks=[...]``: Keras calls callbacks in list order and adds its
progress bar and ``History`` after the user's, so they see the averaged numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ringtrain import runtime
from ringtrain.collectives import Average, allgather_object, allreduce_
from ringtrain.errors import ConfigError
from ringtrain.keras._backend import load_keras
from ringtrain.replicate import broadcast_tensors_

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateWarmupCallback",
    "LearningRateScheduleCallback",
    "broadcast_variables",
    "model_state_variables",
]

keras = load_keras()


def _rng_state_ids(model: Any) -> set[int]:
    """ids of the seed-generator states inside ``model`` (dropout and other random layers).

    They stay per rank: broadcasting them would give every rank the same dropout masks.
    Keras lists them among ``model.variables`` and has no public way to tell them apart,
    so this reads the layers' ``_seed_generators`` (Keras 3).
    """
    ids: set[int] = set()
    layers = model._flatten_layers(include_self=True) if hasattr(model, "_flatten_layers") else [model]
    for layer in layers:
        for generator in getattr(layer, "_seed_generators", ()):
            state = getattr(generator, "state", None)
            if state is not None:
                ids.add(id(state))
    return ids


def model_state_variables(model: Any) -> list[Any]:
    """The model's variables that define its state (weights, batch-norm statistics),
    in Keras' order, without random-number-generator states."""
    rng = _rng_state_ids(model)
    return [v for v in model.variables if id(v) not in rng]


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0) -> None:
    """Overwrite Keras variables with ``root_rank``'s values, fused by dtype."""
    tensors = [v.value for v in variables]
    bad = [t for t in tensors if not isinstance(t, torch.Tensor)]
    if bad:
        raise ConfigError(
            f"{len(bad)} variable(s) are not torch tensors; ringtrain.keras needs KERAS_BACKEND=torch"
        )
    broadcast_tensors_(tensors, root_rank, "Keras variables")


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
    """At the start of training, copy rank ``root_rank``'s variables to every rank.

    Covers the model's weights and non-trainable state (batch-norm statistics) and the
    optimizer's variables (iteration count, learning rate, moments), so a run restored
    on rank 0 only, or started from different random initialisations, continues from one
    state everywhere. The optimizer is built first if ``fit`` has not built it yet.
    Broadcasting happens once per callback object (Horovod's behaviour).

    Args:
        root_rank: the rank whose variables every rank gets.
        device: Horovod's; accepted, with no effect (the job's device is used).
        local_variables: a variable or variables that stay per rank (Horovod's).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        runtime.world()
        if not 0 <= root_rank < runtime.size():
            raise ConfigError(f"root_rank {root_rank} is outside the world of size {runtime.size()}")
        self.root_rank = root_rank
        self.broadcast_done = False
        if local_variables is None:
            local_variables = []
        elif isinstance(local_variables, keras.Variable):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        if not all(isinstance(v, keras.Variable) for v in local_variables):
            raise ConfigError("local_variables must be keras.Variable objects (or one of them)")
        self._local_ids = {id(v) for v in local_variables}

    def register_local_var(self, var: Any) -> None:
        """Keep ``var`` per rank (not broadcast), as Horovod's."""
        if not isinstance(var, keras.Variable):
            raise ConfigError(f"register_local_var takes a keras.Variable, got {type(var).__name__}")
        self._local_ids.add(id(var))

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.broadcast_done:
            return
        variables = model_state_variables(self.model)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables([v for v in variables if id(v) not in self._local_ids], self.root_rank)
        self.broadcast_done = True


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return hasattr(value, "item") and getattr(value, "ndim", 1) == 0


class MetricAverageCallback(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
    """Replace each numeric entry of the epoch's logs by its average over ranks.

    Each rank computes its metrics on its own shard; averaging them at the end of the
    epoch gives the numbers a single process would have reported (exactly so for
    metrics that are means over equally many samples per rank). One fused allreduce per
    epoch; ranks whose logs hold different keys get a ConfigError, not a hang.
    ``device`` is Horovod's, accepted with no effect (the job's device is used).
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is None or runtime.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        everyone = allgather_object(keys, name="epoch metric names")
        if any(other != keys for other in everyone):
            differing = [r for r, other in enumerate(everyone) if other != everyone[0]]
            raise ConfigError(
                f"ranks log different metrics at the end of epoch {epoch}: rank 0 has "
                f"{everyone[0]}, rank {differing[0]} has {everyone[differing[0]]}; compile "
                "the same model with the same metrics on every rank"
            )
        if not keys:
            return
        # On the job's device: NCCL reduces CUDA tensors only.
        values = torch.tensor([float(logs[k]) for k in keys], dtype=torch.float64,
                              device=runtime.device())
        allreduce_(values, op=Average, name="epoch metrics")
        for key, value in zip(keys, values.tolist(), strict=False):
            logs[key] = value


#: id(optimizer) -> its momentum before this step's momentum corrections.
_TRUE_MOMENTUM: dict[int, float] = {}


class _RateCallback(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
    """What the learning-rate callbacks share: set the rate with momentum correction,
    find the batches per epoch, log the rate as ``lr`` at the end of each epoch."""

    momentum_correction: bool
    steps_per_epoch: int | None

    def __init__(self) -> None:
        super().__init__()
        self._epoch = 0
        self._corrected = False

    def _optimizer(self) -> Any:
        """The optimizer that holds the rate and the momentum: the model's, or the one a
        ``LossScaleOptimizer`` wraps (``compile`` adds one under ``mixed_float16``; it
        forwards the rate but not ``momentum``, which TensorFlow's wrapper, Horovod's
        case, delegates to the inner optimizer, so the correction would be skipped)."""
        optimizer = self.model.optimizer
        while getattr(optimizer, "inner_optimizer", None) is not None:
            optimizer = optimizer.inner_optimizer
        return optimizer

    def _check_float_rate(self) -> None:
        rate = self._optimizer()._learning_rate
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) or not hasattr(rate, "assign"):
            raise ConfigError(
                f"{type(self).__name__} sets the optimizer's learning rate, which is a schedule "
                "here; give the optimizer a float rate, or fold this change into the schedule"
            )

    def _find_steps_per_epoch(self) -> int:
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ConfigError(
                f"{type(self).__name__} needs the number of batches per epoch: pass "
                "steps_per_epoch= (fit did not report it for this input)"
            )
        return int(steps)

    def _set_rate(self, new: float) -> float:
        """Set the rate to ``new``; returns it as the optimizer stores it."""
        optimizer = self._optimizer()
        old = float(optimizer.learning_rate)
        optimizer.learning_rate = new
        momentum: Any = getattr(optimizer, "momentum", None)
        if self.momentum_correction and _is_number(momentum) and float(momentum) > 0 and old > 0 \
                and new != old:
            # Two callbacks may correct the same step (they compose); the momentum from
            # before the first correction is what the first restore puts back.
            _TRUE_MOMENTUM.setdefault(id(optimizer), float(momentum))
            optimizer.momentum = float(momentum) * new / old
            self._corrected = True
        return float(optimizer.learning_rate)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._corrected:
            self._corrected = False
            optimizer = self._optimizer()
            true = _TRUE_MOMENTUM.pop(id(optimizer), None)
            if true is not None:
                optimizer.momentum = true

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate)  # Horovod's key


class LearningRateWarmupCallback(_RateCallback):
    """Gradual warmup (Goyal et al. 2017): from ``initial_lr / size`` to ``initial_lr``.

    The rate is set before every batch of the first ``warmup_epochs`` epochs, as
    Horovod's callback sets it: before step ``t`` (counted from the first batch of
    epoch 0) to ``initial_lr * (s + (1 - s) * (t + 1) / warmup_steps)``, so the last
    warmup step runs at ``initial_lr``. From then on the callback leaves the rate alone,
    so schedules (a ``keras.callbacks.LearningRateScheduler`` at the start of the next
    epoch) and ``ReduceLROnPlateau`` take over.

    Args:
        initial_lr: the target rate, normally ``rt.scale_lr(base_lr)``.
        warmup_epochs: epochs of warmup (the paper uses 5).
        momentum_correction: for optimizers whose update holds the rate inside the
            momentum buffer (Keras SGD, RMSprop), multiply the momentum by
            ``new_lr / old_lr`` for the step where the rate changes (the paper's
            "momentum correction", as Horovod does).
        steps_per_epoch: batches per epoch; default: what ``fit`` reports.
        start_factor: where the ramp starts, as a fraction of ``initial_lr``
            (default ``1 / size()``, the single-worker rate).
        verbose: print the final rate on rank 0 when warmup ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, start_factor: float | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        if not (_is_number(initial_lr) and float(initial_lr) > 0):
            raise ConfigError(f"initial_lr must be a number > 0 (the rate the warmup reaches), "
                              f"got {initial_lr!r}")
        if warmup_epochs < 0:
            raise ConfigError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ConfigError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        start = 1.0 / runtime.size() if start_factor is None else start_factor
        if not 0 < start <= 1:
            raise ConfigError(f"start_factor must be in (0, 1], got {start}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.start_factor = start
        self.verbose = verbose
        self._warmup_steps = 0
        self._finished = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._check_float_rate()
        self.steps_per_epoch = self._find_steps_per_epoch()
        self._warmup_steps = math.ceil(self.warmup_epochs * self.steps_per_epoch)
        # Decided by the epoch and batch again in each fit, as Horovod's: a second fit
        # from epoch 0 warms up again.
        self._finished = False

    def lr_at(self, epoch: int, batch: int) -> float:
        """The rate the callback sets before ``batch`` of ``epoch`` (pure; ``initial_lr``
        from the warmup's last step on)."""
        if self.steps_per_epoch is None:
            raise ConfigError("lr_at needs steps_per_epoch: pass it, or ask after fit() began")
        step = epoch * self.steps_per_epoch + batch
        # Horovod's ramp counts the step being taken ((t + 1) / W): it reaches initial_lr
        # at the last warmup step and never touches the batch after it, where an epoch-
        # begin scheduler may have set another rate (ringtrain's t / W ended one step
        # short and set initial_lr over such a rate: a whole epoch 10x off).
        # Over warmup_epochs * steps_per_epoch steps exactly, as Horovod's fractional epoch
        # (rounding it up to whole steps, 4.5 -> 5, made every warmup batch's rate differ).
        span = self.warmup_epochs * self.steps_per_epoch
        if span <= 0 or step + 1 >= span:
            return self.initial_lr
        return self.initial_lr * (self.start_factor + (1.0 - self.start_factor) * (step + 1) / span)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._finished:
            return
        step = self._epoch * (self.steps_per_epoch or 0) + batch
        if step >= self._warmup_steps:
            self._finished = True  # past the warmup (or resumed past it): the rate is left alone
            return
        new = self._set_rate(self.lr_at(self._epoch, batch))
        if step == self._warmup_steps - 1 and self.verbose and runtime.rank() == 0:
            # Printed like Keras' own verbose callbacks (ReduceLROnPlateau), on request.
            print(f"Epoch {self._epoch + 1}: finished gradual learning rate warmup to {new:g}.",
                  flush=True)


class LearningRateScheduleCallback(_RateCallback):
    """Horovod's schedule: from epoch ``start_epoch`` until ``end_epoch`` (exclusive), the
    rate is ``initial_lr * multiplier(epoch)``.

    ``multiplier`` is a number ``m``, as in Horovod exponential decay from ``start_epoch``
    (the rate is ``initial_lr * m ** (epoch - start_epoch)``: ``initial_lr`` itself in
    ``start_epoch``, so a constant step down is ``lambda epoch: 0.1``), or a function of
    the epoch. With ``staircase=True`` the rate is set before the first
    batch of each epoch, from the integer epoch; with ``staircase=False`` before every
    batch, from the fractional epoch ``epoch + batch / steps_per_epoch``. Outside
    ``[start_epoch, end_epoch)`` the callback leaves the rate alone, so several of them
    (with :class:`LearningRateWarmupCallback` before the first) make a piecewise schedule.

    Args:
        initial_lr: the rate the multiplier applies to, normally ``rt.scale_lr(base_lr)``.
        multiplier: a number or a function ``epoch -> factor``.
        start_epoch: first epoch the schedule applies to.
        end_epoch: epoch it stops applying to (exclusive); None: to the end.
        staircase: per epoch (True) or per batch (False).
        momentum_correction: as in :class:`LearningRateWarmupCallback`.
        steps_per_epoch: batches per epoch for ``staircase=False``; default: what ``fit``
            reports.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if not (_is_number(initial_lr) and float(initial_lr) > 0):
            raise ConfigError(f"initial_lr must be a number > 0, got {initial_lr!r}")
        if not callable(multiplier) and not _is_number(multiplier):
            raise ConfigError(f"multiplier must be a number or a function of the epoch, got {multiplier!r}")
        if start_epoch < 0:
            raise ConfigError(f"start_epoch must be >= 0, got {start_epoch}")
        if end_epoch is not None and end_epoch <= start_epoch:
            raise ConfigError(f"end_epoch ({end_epoch}) must be after start_epoch ({start_epoch}), or None")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ConfigError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier: Callable[[float], float] = multiplier
        else:
            base = float(multiplier)
            self.multiplier = lambda epoch: base ** (epoch - start_epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._check_float_rate()
        if not self.staircase:
            self.steps_per_epoch = self._find_steps_per_epoch()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        epoch = self._epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._set_rate(self.initial_lr * float(self.multiplier(epoch)))
        else:
            assert self.steps_per_epoch is not None  # found in on_train_begin
            self._set_rate(self.initial_lr * float(self.multiplier(epoch + batch / self.steps_per_epoch)))


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):  # type: ignore[misc,name-defined]
    """Horovod's ``BestModelCheckpoint``: rank 0 saves the whole model to ``filepath``
    each time ``monitor`` improves (``ModelCheckpoint`` with ``save_best_only=True``);
    the other ranks save nothing.

    Put :class:`MetricAverageCallback` before it, so rank 0 decides on the metric
    averaged over ranks. Horovod leaves ``filepath`` to be set later (its Spark
    estimator does); Keras 3 needs it when the callback is made, so pass it here (a
    ``.keras`` path).
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: str | int = "epoch", *, filepath: str | None = None) -> None:
        if filepath is None:
            raise ConfigError(
                "BestModelCheckpoint needs filepath= (a .keras path): Keras 3's ModelCheckpoint "
                "takes it when the callback is made"
            )
        runtime.world()
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)

    def _save_model(self, epoch: int, batch: int | None, logs: dict[str, Any] | None) -> None:
        # Every rank holds the same model; one writer, as Horovod's examples save on rank 0.
        if runtime.rank() == 0:
            super()._save_model(epoch, batch, logs)
            return
        # The others track ``best`` as rank 0 does (a script may read it on every rank).
        verbose = int(getattr(self, "verbose", 0))
        self.verbose = 0
        try:
            self._should_save_model(epoch, batch, logs, self._get_file_path(epoch, batch, logs))
        finally:
            self.verbose = verbose
