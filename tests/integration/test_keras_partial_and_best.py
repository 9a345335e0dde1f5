"""Horovod Keras names that were missing, on 2 real ranks: ``PartialDistributedOptimizer``
(local layers keep their gradients), ``callbacks.BestModelCheckpoint`` (rank 0 saves the
best model), ``process_set=`` (the global set only), and a ``DistributedOptimizer``
inside Keras' ``LossScaleOptimizer`` (one exchange per step, skipped steps in step).

One world runs every scenario (Keras costs seconds to import per process); Keras is
imported only in the rank processes.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import pytest
from ringtest import error_of, run_scenarios, run_world

if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras 3 is not installed (pip install 'ringtrain[keras]')", allow_module_level=True)

pytestmark = pytest.mark.system  # a Keras world costs ~5 s

N = 2
LR = 0.1


def _two_layers(keras: Any) -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="tanh", name="shared"),
                             keras.layers.Dense(1, name="local")])


def _rank_data(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(10 + rank)
    return rng.standard_normal((4, 3)).astype("float32"), rng.standard_normal((4, 1)).astype("float32")


def _partial(hvd: Any, keras: Any, scale: bool) -> dict[str, Any]:
    """One SGD step: the shared layer moves by the ranks' averaged gradient, the local one
    by this rank's own gradient (divided by size with scale_local_gradients)."""
    x, y = _rank_data(hvd.rank())
    plain = _two_layers(keras)
    start = [w.copy() for w in plain.get_weights()]
    plain.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    own = [a - b for a, b in zip(plain.get_weights(), start, strict=True)]  # -LR * local grad
    everyone = [np.asarray(hvd.allgather(d[None])) for d in own]

    model = _two_layers(keras)
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=model.get_layer("local"),
                                          scale_local_gradients=scale)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    got = [a - b for a, b in zip(model.get_weights(), start, strict=True)]
    expected = [e.mean(0) for e in everyone[:2]] + [d / (N if scale else 1) for d in own[2:]]
    return {"close": all(np.allclose(g, e, atol=1e-6) for g, e in zip(got, expected, strict=True)),
            "local_differs": not np.allclose(everyone[2][0], everyone[2][1])}


def _best_checkpoint(hvd: Any, keras: Any, folder: str) -> dict[str, Any]:
    x, y = _rank_data(hvd.rank())
    model = _two_layers(keras)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    path = os.path.join(folder, f"best_r{hvd.rank()}.keras")
    best = hvd.callbacks.BestModelCheckpoint(monitor="loss", filepath=path)
    model.fit(x, y, batch_size=2, epochs=3, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.MetricAverageCallback(), best])
    return {"saved": os.path.exists(path), "best": float(best.best),
            "no_path": error_of(lambda: hvd.callbacks.BestModelCheckpoint(monitor="loss"))}


def _process_sets(hvd: Any, keras: Any) -> dict[str, Any]:
    from ringtrain.horovod import ProcessSet

    subset = ProcessSet([0])
    return {
        "global_ok": error_of(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(LR),
                                                               process_set=hvd.global_process_set)),
        "subset_opt": error_of(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(LR), process_set=subset)),
        "subset_partial": error_of(lambda: hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR),
                                                                           process_set=subset)),
        "subset_allreduce": error_of(lambda: hvd.allreduce(1.0, process_set=subset)),
        "unbuilt_local": error_of(lambda: hvd.PartialDistributedOptimizer(
            keras.optimizers.SGD(LR), local_layers=keras.layers.Dense(1))),
        "global_allreduce": float(np.asarray(hvd.allreduce(float(hvd.rank()), process_set=hvd.global_process_set))),
        # Horovod's second positional argument is name=: a clear error, not a wrong wrap.
        "positional_name": error_of(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(LR), "opt")),
    }


def _loss_scaled(hvd: Any, keras: Any) -> dict[str, Any]:
    """LossScaleOptimizer(DistributedOptimizer(SGD)); batch 1 of each epoch overflows on
    rank 1 only: every rank skips it, keeps the warmup's rates, and no step exchanges
    twice (the overlap's warning is the symptom of the repeated exchange)."""
    import warnings

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD(LR)))
    model.compile(optimizer=opt, loss="mse")
    x = np.ones((8, 3), "float32")
    y = np.zeros((8, 1), "float32")
    if hvd.rank() == 1:
        x[2:4] = 1e30
    rates: list[float] = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rates.append(float(self.model.optimizer.learning_rate))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.LearningRateWarmupCallback(LR, warmup_epochs=1), Probe()])
    return {"repeated": [str(w.message) for w in caught if "repeated" in str(w.message)],
            "rates": rates, "iterations": int(opt.iterations.numpy()),
            "weights": [w.tolist() for w in model.get_weights()]}


def _local_broadcast(hvd: Any, keras: Any) -> list[float]:
    model = _two_layers(keras)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    kernel = model.get_layer("local").kernel
    kernel.assign(np.full((2, 1), float(hvd.rank()), "float32"))
    shared = model.get_layer("shared").kernel
    shared.assign(np.full((3, 2), float(hvd.rank() + 5), "float32"))
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    cb.register_local_var(kernel)
    cb.set_model(model)
    cb.on_train_begin()
    return [float(keras.ops.convert_to_numpy(kernel)[0, 0]), float(keras.ops.convert_to_numpy(shared)[0, 0])]


def _fractional_warmup(hvd: Any, keras: Any) -> list[float]:
    """warmup_epochs=1.5 over 3 batches per epoch: the rate before each of the 6 batches."""
    model = _two_layers(keras)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    x, y = _rank_data(hvd.rank())
    rates: list[float] = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            rates.append(float(self.model.optimizer.learning_rate))

    model.fit(x[:3], y[:3], batch_size=1, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.LearningRateWarmupCallback(LR, warmup_epochs=1.5), Probe()])
    return rates


def _root_one(hvd: Any, keras: Any) -> list[float]:
    """BroadcastGlobalVariablesCallback(1): rank 1's weights and optimizer state everywhere."""
    model = _two_layers(keras)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)), loss="mse")
    model.optimizer.build(model.trainable_variables)
    for v in model.trainable_variables:
        v.assign(np.full(v.shape, float(hvd.rank() + 1), "float32"))
    model.optimizer.iterations.assign(7 * hvd.rank())
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(1)
    cb.set_model(model)
    cb.on_train_begin()
    return [float(keras.ops.convert_to_numpy(v).ravel()[0]) for v in model.trainable_variables] + [
        int(keras.ops.convert_to_numpy(model.optimizer.iterations))]


def _validation_average(hvd: Any, keras: Any) -> dict[str, Any]:
    """MetricAverageCallback averages val_ entries too: the logged val_loss / val_mae are
    the means of each rank's own evaluation of the final weights."""
    x, y = _rank_data(hvd.rank())
    xv, yv = _rank_data(5 + hvd.rank())
    model = _two_layers(keras)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse", metrics=["mae"])
    history = model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, validation_data=(xv, yv),
                        callbacks=[hvd.callbacks.MetricAverageCallback()])
    own = model.evaluate(xv, yv, batch_size=2, verbose=0, return_dict=True)
    mean = {k: float(np.asarray(hvd.allreduce(float(v)))) for k, v in sorted(own.items())}
    return {"logged": {k: history.history[f"val_{k}"][0] for k in mean}, "mean": mean}


def _world(folder: str) -> dict[str, Any]:
    import ringtrain.keras as hvd

    keras = hvd.load_keras()
    hvd.init()
    return run_scenarios([
        ("partial", lambda: _partial(hvd, keras, True)),
        ("partial_unscaled", lambda: _partial(hvd, keras, False)),
        ("best", lambda: _best_checkpoint(hvd, keras, folder)),
        ("process_sets", lambda: _process_sets(hvd, keras)),
        ("local_broadcast", lambda: _local_broadcast(hvd, keras)),
        ("fractional_warmup", lambda: _fractional_warmup(hvd, keras)),
        ("root_one", lambda: _root_one(hvd, keras)),
        ("validation_average", lambda: _validation_average(hvd, keras)),
        ("loss_scaled", lambda: _loss_scaled(hvd, keras)),
    ])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(_world, N, str(tmp_path_factory.mktemp("best")), timeout=110)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["partial", "partial_unscaled"])
def test_partial_optimizer_keeps_local_layers_gradients_local(world: list[dict[str, Any]], case: str) -> None:
    for rank in range(N):
        assert world[rank][case] == {"close": True, "local_differs": True}, world[rank][case]


@pytest.mark.timeout(120)
def test_best_model_checkpoint_saves_on_rank_zero_only(world: list[dict[str, Any]]) -> None:
    r0, r1 = world[0]["best"], world[1]["best"]
    assert r0["saved"] and not r1["saved"]
    assert r0["best"] == r1["best"]  # decided on the averaged metric
    assert r0["no_path"] is not None and r0["no_path"][0] == "ConfigError" and "filepath=" in r0["no_path"][1]


@pytest.mark.timeout(120)
def test_process_set_other_than_the_whole_job_is_refused(world: list[dict[str, Any]]) -> None:
    got = world[0]["process_sets"]
    assert got["global_ok"] is None
    for key in ("subset_opt", "subset_partial", "subset_allreduce"):
        assert got[key] is not None and got[key][0] == "ConfigError" and "process_set=" in got[key][1], got[key]
    assert got["unbuilt_local"] is not None and "not built" in got["unbuilt_local"][1]
    assert got["global_allreduce"] == 0.5
    assert got["positional_name"] is not None and "pass name=" in got["positional_name"][1], got


@pytest.mark.timeout(120)
def test_broadcast_callback_register_local_var(world: list[dict[str, Any]]) -> None:
    assert world[0]["local_broadcast"][0] == 0.0 and world[1]["local_broadcast"][0] == 1.0
    assert world[0]["local_broadcast"][1] == world[1]["local_broadcast"][1] == 5.0  # rank 0's


@pytest.mark.timeout(120)
def test_loss_scale_optimizer_exchanges_once_and_stays_in_step(world: list[dict[str, Any]]) -> None:
    r0, r1 = world[0]["loss_scaled"], world[1]["loss_scaled"]
    assert r0["repeated"] == [] and r1["repeated"] == []
    assert r0["rates"] == r1["rates"] and r0["rates"][3] == pytest.approx(LR)
    assert r0["iterations"] == r1["iterations"] == 6  # Keras 3 counts applied steps only
    assert r0["weights"] == r1["weights"]


@pytest.mark.timeout(120)
def test_fractional_warmup_ramps_as_horovod(world: list[dict[str, Any]]) -> None:
    """Horovod's multiplier at fractional epoch e + (b + 1) / S is (e * (n-1) / W + 1) / n;
    from the step where it reaches 1 on, ringtrain holds initial_lr (docs/keras.md)."""
    steps, warmup = 3, 1.5
    expected = []
    for t in range(6):
        frac = (t + 1) / steps
        expected.append(LR * min(1.0, (frac * (N - 1) / warmup + 1) / N))
    assert world[0]["fractional_warmup"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.timeout(120)
def test_broadcast_from_root_rank_one(world: list[dict[str, Any]]) -> None:
    assert world[0]["root_one"] == world[1]["root_one"] == [2.0] * 4 + [7]


@pytest.mark.timeout(120)
def test_metric_average_averages_validation_metrics(world: list[dict[str, Any]]) -> None:
    for rank in range(N):
        got = world[rank]["validation_average"]
        assert got["logged"] == pytest.approx(got["mean"], rel=1e-5), got
