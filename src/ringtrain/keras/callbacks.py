"""Horovod's Keras callbacks on ringtrain: same start, same logs, gradual warmup.

- :class:`BroadcastGlobalVariablesCallback` gives every rank rank 0's model and
  optimizer variables when training begins (step 4 of the article's six).
- :class:`MetricAverageCallback` averages the epoch's metrics over ranks, so every
  rank logs, checkpoints and early-stops on the same numbers.
- :class:`LearningRateWarmupCallback` ramps the learning rate from the single-worker
  rate to the scaled one over the first epochs (Goyal et al. 2017, section 2.2).

Put them first in ``callbacks=[...]``: Keras calls callbacks in list order and adds its
progress bar and ``History`` after the user's, so they see the averaged numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ringtrain import runtime
from ringtrain.collectives import Average, allgather_object, allreduce_
from ringtrain.errors import ConfigError
from ringtrain.keras._backend import load_keras
from ringtrain.replicate import broadcast_tensors_
from ringtrain.schedule import warmup_factor

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateWarmupCallback",
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
    """

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        runtime.world()
        if not 0 <= root_rank < runtime.size():
            raise ConfigError(f"root_rank {root_rank} is outside the world of size {runtime.size()}")
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.broadcast_done:
            return
        variables = model_state_variables(self.model)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank)
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
    """

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


class LearningRateWarmupCallback(keras.callbacks.Callback):  # type: ignore[misc,name-defined]
    """Gradual warmup (Goyal et al. 2017): from ``initial_lr / size`` to ``initial_lr``.

    The rate is set before every batch of the first ``warmup_epochs`` epochs, linearly
    in the step count (:func:`ringtrain.schedule.warmup_factor`), and is ``initial_lr``
    from then on; afterwards the callback leaves the rate alone, so schedules and
    ``ReduceLROnPlateau`` take over.

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
        if not initial_lr > 0:
            raise ConfigError(f"initial_lr must be > 0, got {initial_lr}")
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
        self._epoch = 0
        self._warmup_steps = 0
        self._restore_momentum: float | None = None
        self._finished = False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = self.model.optimizer
        if isinstance(optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule) \
                or not hasattr(optimizer._learning_rate, "assign"):
            raise ConfigError(
                "LearningRateWarmupCallback sets the optimizer's learning rate, which is a "
                "schedule here; give the optimizer a float rate, or fold the warmup into the schedule"
            )
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ConfigError(
                "LearningRateWarmupCallback needs the number of batches per epoch: pass "
                "steps_per_epoch= (fit did not report it for this input)"
            )
        self.steps_per_epoch = int(steps)
        self._warmup_steps = math.ceil(self.warmup_epochs * self.steps_per_epoch)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def lr_at(self, epoch: int, batch: int) -> float:
        """The rate the callback sets before ``batch`` of ``epoch`` (pure)."""
        if self.steps_per_epoch is None:
            raise ConfigError("lr_at needs steps_per_epoch: pass it, or ask after fit() began")
        step = epoch * self.steps_per_epoch + batch
        return self.initial_lr * warmup_factor(step, self._warmup_steps, self.start_factor)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._finished:
            return
        step = self._epoch * (self.steps_per_epoch or 0) + batch
        if step > self._warmup_steps:
            return  # resumed past the warmup: leave the rate alone
        optimizer = self.model.optimizer
        old = float(optimizer.learning_rate)
        new = self.lr_at(self._epoch, batch)
        optimizer.learning_rate = new
        momentum: Any = getattr(optimizer, "momentum", None)
        if self.momentum_correction and _is_number(momentum) and float(momentum) > 0 and old > 0 \
                and new != old:
            self._restore_momentum = float(momentum)
            optimizer.momentum = float(momentum) * new / old
        if step == self._warmup_steps:
            self._finished = True
            if self.verbose and runtime.rank() == 0:
                # Printed like Keras' own verbose callbacks (ReduceLROnPlateau), on request.
                print(f"Epoch {self._epoch + 1}: finished gradual learning rate warmup to {new:g}.",
                      flush=True)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum = self._restore_momentum
            self._restore_momentum = None
