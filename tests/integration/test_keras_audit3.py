"""A horovod.keras script on ``import ringtrain.keras as hvd``: learning-rate callbacks
(warmup, Horovod's piecewise schedule, Keras' own scheduler) and the module collectives.

One 2-rank world runs every scenario (Keras costs seconds to import per process); Keras
is imported only in the rank processes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from ringtest import run_world

if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras 3 is not installed (pip install 'ringtrain[keras]')", allow_module_level=True)

N = 2      # ranks
B = 2      # rows per fit step on each rank
STEPS = 4  # fit steps per epoch
EPOCHS = 4
LR = 0.05


def _warmup_then_keras_scheduler(hvd: Any, keras: Any) -> dict[str, list[float]]:
    """One epoch of warmup, then keras.callbacks.LearningRateScheduler drops the rate to
    LR / 10 at the start of epoch 1: epoch 1 must run at LR / 10 whatever the order, and
    when fit resumes at epoch 1. Resumed at epoch 1 without a scheduler, from the ramp's
    last rate (as a checkpoint saved it), the rate stays LR."""
    x = np.ones((B * STEPS, 3), "float32")
    y = np.zeros((B * STEPS, 1), "float32")
    out: dict[str, list[float]] = {}
    for order in ("scheduler_first", "warmup_first", "resumed", "resumed_no_scheduler"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
        warmup = hvd.callbacks.LearningRateWarmupCallback(LR, warmup_epochs=1)
        scheduler = keras.callbacks.LearningRateScheduler(lambda epoch, lr: LR if epoch < 1 else LR / 10)
        seen: list[float] = []

        class Probe(keras.callbacks.Callback):
            def __init__(self, seen: list[float]) -> None:
                super().__init__()
                self.seen = seen

            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                self.seen.append(float(self.model.optimizer.learning_rate))

        callbacks = [scheduler, warmup] if order == "scheduler_first" else [warmup, scheduler]
        initial_epoch = 0
        if order.startswith("resumed"):
            initial_epoch = 1
            model.optimizer.learning_rate = LR  # where Horovod's ramp ends
            if order == "resumed_no_scheduler":
                callbacks = [warmup]
        model.fit(x, y, batch_size=B, epochs=2, initial_epoch=initial_epoch, shuffle=False, verbose=0,
                  callbacks=[*callbacks, Probe(seen)])
        out[order] = seen
    return out


def _linear_decay(epoch: float) -> float:
    return 0.1 * (1 - (epoch - 3) / 2)


def _horovod_schedule(hvd: Any, keras: Any) -> dict[str, Any]:
    """Horovod's ImageNet recipe in small: warmup for 1 epoch, then a constant multiplier
    0.5 over epochs 1-2 (Horovod's exponential decay: x1, then x0.5, staircase) and a
    per-batch linear decay from epoch 3, SGD with momentum correction. Two ranks with
    half the rows each must end where one process with the whole batch ends."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N * B * STEPS, 4)).astype("float32")
    y = rng.standard_normal((N * B * STEPS, 2)).astype("float32")

    def model_for(seed: int) -> Any:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh"),
                                 keras.layers.Dense(2)])

    def schedule() -> list[Any]:
        return [
            hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=1, start_factor=1 / N),
            hvd.callbacks.LearningRateScheduleCallback(initial_lr=LR, multiplier=0.5, start_epoch=1, end_epoch=3),
            hvd.callbacks.LearningRateScheduleCallback(initial_lr=LR, multiplier=_linear_decay,
                                                       start_epoch=3, staircase=False),
        ]

    initial = model_for(0).get_weights()
    rank = hvd.rank()
    rows = np.concatenate([np.arange(s * N * B + rank * B, s * N * B + (rank + 1) * B)
                           for s in range(STEPS)])
    model = model_for(rank)  # broadcast makes rank 1 start from rank 0's weights
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss="mse")
    rates: list[float] = []
    momenta: list[float] = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rates.append(float(self.model.optimizer.learning_rate))

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            momenta.append(float(self.model.optimizer.momentum))

    history = model.fit(x[rows], y[rows], batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback(), *schedule(), Probe()])
    out: dict[str, Any] = {"weights": model.get_weights(), "rates": rates, "momenta": momenta,
                           "lr_log": history.history["lr"]}
    if rank == 0:
        reference = model_for(0)
        reference.set_weights(initial)
        reference.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9), loss="mse")
        reference.fit(x, y, batch_size=N * B, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=schedule())
        out["reference"] = reference.get_weights()
    return out


def _two_corrections_one_step(hvd: Any, keras: Any) -> list[float]:
    """Two per-batch schedules over the same epochs both correct the momentum of a step:
    after each batch it must be the optimizer's own 0.9 again."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss="mse")
    after: list[float] = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            after.append(float(self.model.optimizer.momentum))

    callbacks = [hvd.callbacks.LearningRateScheduleCallback(LR, lambda e: 1 + e, staircase=False),
                 hvd.callbacks.LearningRateScheduleCallback(LR, lambda e: 2 + e, staircase=False)]
    model.fit(np.ones((B * STEPS, 3), "float32"), np.zeros((B * STEPS, 1), "float32"), batch_size=B,
              epochs=1, shuffle=False, verbose=0, callbacks=[*callbacks, Probe()])
    return after


def _collectives(hvd: Any) -> dict[str, Any]:
    r = hvd.rank()
    resume = hvd.broadcast(7 if r == 0 else 0, 0, name="resume_from_epoch")  # Horovod's resume idiom
    gathered = hvd.allgather(np.full((r + 1, 2), float(r)), name="rows")
    scattered = hvd.reducescatter(np.arange(4.0) * (r + 1), name="scatter", op=hvd.Sum)
    return {"resume": int(resume), "gathered": np.asarray(gathered).tolist(),
            "scattered": np.asarray(scattered).tolist(),
            "ranks": (hvd.cross_rank(), hvd.cross_size(), hvd.is_initialized())}


def _unused_variable(hvd: Any, keras: Any) -> dict[str, float]:
    """A trainable layer the model never calls: no rank has a gradient for it, so Keras
    skips it, as in one process; a zero gradient let AdamW's weight decay move it."""
    moved = {}
    for passes in (1, 2):
        keras.utils.set_random_seed(0)

        class Branches(keras.Model):  # type: ignore[misc,name-defined]
            def __init__(self) -> None:
                super().__init__()
                self.used = keras.layers.Dense(1)
                self.idle = keras.layers.Dense(1)

            def build(self, shape: Any) -> None:
                self.used.build(shape)
                self.idle.build(shape)

            def call(self, x: Any) -> Any:
                return self.used(x)

        model = Branches()
        model.build((None, 3))
        opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.5),
                                       backward_passes_per_step=passes)
        model.compile(optimizer=opt, loss="mse")
        start = np.asarray(model.idle.kernel.numpy()).copy()
        model.fit(np.ones((B * STEPS, 3), "float32"), np.zeros((B * STEPS, 1), "float32"),
                  batch_size=B, epochs=1, shuffle=False, verbose=0)
        moved[f"passes{passes}"] = float(np.abs(np.asarray(model.idle.kernel.numpy()) - start).max())
    return moved


def _world() -> dict[str, Any]:
    import ringtrain.keras as hvd

    keras = hvd.load_keras()
    hvd.init()
    return {
        "keras_scheduler": _warmup_then_keras_scheduler(hvd, keras),
        "schedule": _horovod_schedule(hvd, keras),
        "two_corrections": _two_corrections_one_step(hvd, keras),
        "collectives": _collectives(hvd),
        "unused": _unused_variable(hvd, keras),
    }


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, N, timeout=110)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["scheduler_first", "warmup_first", "resumed", "resumed_no_scheduler"])
def test_warmup_leaves_the_rate_an_epoch_scheduler_set_after_it(world: list[dict[str, Any]], order: str) -> None:
    seen = world[0]["keras_scheduler"][order]
    if order.startswith("resumed"):
        want = LR if order == "resumed_no_scheduler" else LR / 10
        np.testing.assert_allclose(seen, [want] * STEPS, rtol=1e-6)
        return
    ramp = [LR * (1 / N + (1 - 1 / N) * (step + 1) / STEPS) for step in range(STEPS)]  # Horovod's
    np.testing.assert_allclose(seen[:STEPS], ramp, rtol=1e-6)
    # Epoch 1 ran at LR before: the warmup's last set overrode the scheduler (10x).
    np.testing.assert_allclose(seen[STEPS:], [LR / 10] * STEPS, rtol=1e-6)


@pytest.mark.timeout(120)
def test_horovod_schedule_callbacks_train_as_one_process(world: list[dict[str, Any]]) -> None:
    out = world[0]["schedule"]
    warm = [LR * (1 / N + (1 - 1 / N) * (step + 1) / STEPS) for step in range(STEPS)]
    decay = [LR * _linear_decay(3 + batch / STEPS) for batch in range(STEPS)]
    np.testing.assert_allclose(out["rates"], warm + [LR] * STEPS + [LR * 0.5] * STEPS + decay, rtol=1e-6)
    np.testing.assert_allclose(out["lr_log"], [warm[-1], LR, LR * 0.5, decay[-1]], rtol=1e-6)
    assert all(m == pytest.approx(0.9) for m in out["momenta"])
    for rank in world:
        for got, want in zip(rank["schedule"]["weights"], out["reference"], strict=True):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.timeout(120)
def test_momentum_is_restored_when_two_callbacks_correct_one_step(world: list[dict[str, Any]]) -> None:
    assert world[0]["two_corrections"] == pytest.approx([0.9] * STEPS)


@pytest.mark.timeout(120)
def test_horovod_keras_collectives(world: list[dict[str, Any]]) -> None:
    for r, rank in enumerate(world):
        out = rank["collectives"]
        assert out["resume"] == 7
        assert out["gathered"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert out["scattered"] == ([0.0, 3.0] if r == 0 else [6.0, 9.0])
        assert out["ranks"] == (0, 1, True)


@pytest.mark.timeout(120)
def test_a_variable_no_rank_has_a_gradient_for_stays_put(world: list[dict[str, Any]]) -> None:
    for rank in world:
        assert rank["unused"] == {"passes1": 0.0, "passes2": 0.0}
