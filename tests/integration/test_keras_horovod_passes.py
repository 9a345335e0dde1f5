"""Horovod's Keras semantics that a one-process check cannot see: with
``backward_passes_per_step=k`` Horovod's aggregation helper counts every pass in
``optimizer.iterations`` (so a learning-rate schedule and Adam's bias correction move per
batch), the learning-rate callbacks correct the momentum of the optimizer a
``LossScaleOptimizer`` wraps (TensorFlow's wrapper delegates ``momentum``), and
``on_train_end`` gets the last epoch's logs as Keras made them, unaveraged (Keras hands
each hook a copy, and Horovod's ``MetricAverageCallback`` averages in ``on_epoch_end``).

The expected weights are computed here by hand, in NumPy, from Horovod's rules. One
2-rank world runs every scenario; Keras is imported only in the rank processes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from ringtest import run_scenarios, run_world, scenario_results

if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras 3 is not installed (pip install 'ringtrain[keras]')", allow_module_level=True)

# `make test-system` (docs/testing.md): a second Keras world (Keras costs seconds to
# import in each rank) is more than the fast tier's budget allows.
pytestmark = pytest.mark.system

N = 2       # ranks
B = 2       # rows per fit step on each rank
K = 2       # backward_passes_per_step
STEPS = 5   # fit steps: two full accumulations and one pass left for apply_accumulated
LR0, DECAY = 0.1, 0.8  # ExponentialDecay(LR0, decay_steps=1, DECAY): the rate at step t
ADAM_STEPS = 4


def _data(rank: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(10 + rank)
    return (rng.standard_normal((steps * B, 3)).astype("float32"),
            rng.standard_normal((steps * B, 1)).astype("float32"))


def _model(keras: Any) -> Any:
    keras.utils.set_random_seed(0)  # the same start on every rank
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])


def _schedule(hvd: Any, keras: Any) -> dict[str, Any]:
    """SGD on ExponentialDecay, k=2: iterations and the rate per batch, the weights after
    fit and after apply_accumulated; the logs a callback after MetricAverageCallback sees."""
    model = _model(keras)
    start = [w.copy() for w in model.get_weights()]
    rate = keras.optimizers.schedules.ExponentialDecay(LR0, decay_steps=1, decay_rate=DECAY)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(rate), backward_passes_per_step=K)
    model.compile(optimizer=opt, loss="mse")
    seen: dict[str, Any] = {"lr": [], "iterations": []}

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            seen["lr"].append(float(self.model.optimizer.learning_rate))
            seen["iterations"].append(int(self.model.optimizer.iterations))

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            seen["epoch_end"] = dict(logs or {})

        def on_train_end(self, logs: Any = None) -> None:
            seen["train_end"] = dict(logs or {})

    x, y = _data(hvd.rank(), STEPS)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.MetricAverageCallback(), Probe()])
    seen["after_fit"] = int(opt.iterations)
    seen["weights_fit"] = [w.copy() for w in model.get_weights()]
    opt.apply_accumulated()  # the fifth pass, alone
    seen["after_flush"] = int(opt.iterations)
    seen["weights"] = model.get_weights()
    seen["start"] = start
    return seen


def _adam(hvd: Any, keras: Any, loss_scale: bool) -> dict[str, Any]:
    """Adam, k=2, averaged passes: bias correction at Horovod's step count. With
    loss_scale the DistributedOptimizer wraps a LossScaleOptimizer (its count is the
    inner optimizer's)."""
    model = _model(keras)
    start = [w.copy() for w in model.get_weights()]
    inner = keras.optimizers.Adam(0.01)
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(inner) if loss_scale else inner,
                                   backward_passes_per_step=K, average_aggregated_gradients=True)
    model.compile(optimizer=opt, loss="mse")
    x, y = _data(hvd.rank(), ADAM_STEPS)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    return {"iterations": int(opt.iterations), "weights": model.get_weights(), "start": start}


def _momentum_under_loss_scaling(hvd: Any, keras: Any) -> dict[str, Any]:
    """The warmup corrects SGD's momentum when the model's optimizer is the
    LossScaleOptimizer that mixed_float16's compile puts around the DistributedOptimizer;
    a second fit from epoch 0, after the first went past the warmup, warms up again."""
    model = _model(keras)
    sgd = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(sgd), loss="mse")
    seen: list[float] = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            seen.append(float(sgd.momentum))

    x, y = _data(hvd.rank(), 4)
    warmup = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1)
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[warmup, Probe()])
    out: dict[str, Any] = {"momentum": seen[:], "restored": float(sgd.momentum)}
    rates: list[float] = []

    class Rates(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rates.append(float(sgd.learning_rate))

    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[warmup, Rates()])
    out["refit_rates"] = rates  # a second fit from epoch 0 warms up again, as Horovod's
    return out


def _errors(hvd: Any, keras: Any) -> dict[str, Any]:
    from ringtest import error_of

    scheduled = _model(keras)
    rate = keras.optimizers.schedules.ExponentialDecay(LR0, decay_steps=1, decay_rate=DECAY)
    scheduled.compile(optimizer=keras.optimizers.LossScaleOptimizer(
        hvd.DistributedOptimizer(keras.optimizers.SGD(rate))), loss="mse")
    x, y = _data(hvd.rank(), 2)
    return {
        "both_accumulate": error_of(lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), backward_passes_per_step=2)),
        "warmup_none": error_of(lambda: hvd.callbacks.LearningRateWarmupCallback(None)),
        "schedule_numpy_lr": error_of(lambda: hvd.callbacks.LearningRateScheduleCallback(
            np.float32(0.1), 0.5)),
        "warmup_on_inner_schedule": error_of(lambda: scheduled.fit(
            x, y, batch_size=B, epochs=1, verbose=0,
            callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1)])),
    }


def _world() -> dict[str, Any]:
    import ringtrain.keras as hvd

    keras = hvd.load_keras()
    hvd.init()
    return run_scenarios([("schedule", lambda: _schedule(hvd, keras)),
                          ("adam", lambda: _adam(hvd, keras, False)),
                          ("adam_loss_scale", lambda: _adam(hvd, keras, True)),
                          ("momentum", lambda: _momentum_under_loss_scaling(hvd, keras)),
                          ("errors", lambda: _errors(hvd, keras))])


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, N, timeout=140)


def _grad(w: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """d/dw of Keras' mse on a Dense(1): mean over the rows of (x @ kernel + bias - y)^2."""
    r = x.astype(np.float64) @ w[0] + w[1] - y
    return [2 * x.T @ r / len(x), 2 * r.sum(0) / len(x)]


def _pass_grads(w: list[np.ndarray], step: int, steps: int) -> list[np.ndarray]:
    """One pass: the average over ranks of each rank's gradient on its rows of ``step``."""
    per_rank = [_grad(w, *(a[step * B:(step + 1) * B] for a in _data(r, steps))) for r in range(N)]
    return [sum(g[i] for g in per_rank) / N for i in range(2)]


def _horovod_sgd(start: list[np.ndarray]) -> list[np.ndarray]:
    """Horovod: passes summed; the update after pass t (0-based) runs with iterations == t,
    so at the schedule's rate of step t; apply_accumulated flushes the fifth pass alike."""
    w = [a.astype(np.float64) for a in start]
    total = [np.zeros_like(a) for a in w]
    for t in range(STEPS):
        total = [s + g for s, g in zip(total, _pass_grads(w, t, STEPS), strict=True)]
        if (t + 1) % K == 0 or t == STEPS - 1:
            w = [a - LR0 * DECAY ** t * s for a, s in zip(w, total, strict=True)]
            total = [np.zeros_like(a) for a in w]
    return w


def _horovod_adam(start: list[np.ndarray]) -> list[np.ndarray]:
    """Keras' Adam (epsilon 1e-7) at Horovod's step: the m-th update has iterations + 1 == m * K."""
    b1, b2, eps, lr = 0.9, 0.999, 1e-7, 0.01
    w = [a.astype(np.float64) for a in start]
    m = [np.zeros_like(a) for a in w]
    v = [np.zeros_like(a) for a in w]
    total = [np.zeros_like(a) for a in w]
    for t in range(ADAM_STEPS):
        total = [s + g for s, g in zip(total, _pass_grads(w, t, ADAM_STEPS), strict=True)]
        if (t + 1) % K:
            continue
        local_step = t + 1
        alpha = lr * np.sqrt(1 - b2 ** local_step) / (1 - b1 ** local_step)
        for i, s in enumerate(total):
            g = s / K
            m[i] = m[i] + (g - m[i]) * (1 - b1)
            v[i] = v[i] + (g * g - v[i]) * (1 - b2)
            w[i] = w[i] - alpha * m[i] / (np.sqrt(v[i]) + eps)
        total = [np.zeros_like(a) for a in w]
    return w


@pytest.mark.timeout(150)
def test_iterations_count_passes_so_a_schedule_decays_per_batch(world: list[dict[str, Any]]) -> None:
    outs = scenario_results(world, "schedule")
    for o in outs:
        assert o["iterations"] == list(range(STEPS))
        np.testing.assert_allclose(o["lr"], [LR0 * DECAY ** t for t in range(STEPS)], rtol=1e-6)
        assert o["after_fit"] == STEPS and o["after_flush"] == STEPS
    want = _horovod_sgd(outs[0]["start"])
    for o in outs:
        for got, exp in zip(o["weights"], want, strict=True):
            np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("label", ["adam", "adam_loss_scale"])
def test_adam_bias_correction_uses_horovods_step(world: list[dict[str, Any]], label: str) -> None:
    outs = scenario_results(world, label)
    want = _horovod_adam(outs[0]["start"])
    for o in outs:
        assert o["iterations"] == ADAM_STEPS
        for got, exp in zip(o["weights"], want, strict=True):
            np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(150)
def test_on_train_end_gets_the_unaveraged_logs_as_under_horovod(world: list[dict[str, Any]]) -> None:
    outs = scenario_results(world, "schedule")
    assert outs[0]["epoch_end"] == outs[1]["epoch_end"]  # averaged
    assert outs[0]["train_end"]["loss"] != outs[1]["train_end"]["loss"]  # each rank's own
    mean = (outs[0]["train_end"]["loss"] + outs[1]["train_end"]["loss"]) / N
    assert outs[0]["epoch_end"]["loss"] == pytest.approx(mean, rel=1e-6)


@pytest.mark.timeout(150)
def test_warmup_corrects_the_momentum_inside_a_loss_scale_optimizer(world: list[dict[str, Any]]) -> None:
    rates = [0.1 * (0.5 + 0.5 * (t + 1) / 4) for t in range(4)]
    before = [0.1, *rates[:-1]]
    for o in scenario_results(world, "momentum"):
        corrected = [0.9 * new / old for new, old in zip(rates, before, strict=True)]
        np.testing.assert_allclose(o["momentum"], corrected + [0.9] * 4, rtol=1e-6)  # epoch 1: no change
        assert o["restored"] == pytest.approx(0.9)
        np.testing.assert_allclose(o["refit_rates"], rates, rtol=1e-6)


@pytest.mark.timeout(150)
def test_clear_errors(world: list[dict[str, Any]]) -> None:
    for o in scenario_results(world, "errors"):
        assert o["both_accumulate"] is not None and o["both_accumulate"][0] == "ConfigError"
        assert "gradient_accumulation_steps" in o["both_accumulate"][1]
        assert o["warmup_none"] is not None and o["warmup_none"][0] == "ConfigError"
        assert o["schedule_numpy_lr"] is None  # a NumPy float is a number, as in Horovod
        assert o["warmup_on_inner_schedule"] is not None
        assert o["warmup_on_inner_schedule"][0] == "ConfigError", o["warmup_on_inner_schedule"]
