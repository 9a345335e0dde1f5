"""Horovod Keras scripts on ``import ringtrain.keras as hvd``: horovod.keras's module
calls and ``load_model``; Keras' ``mixed_float16``
policy (which wraps the DistributedOptimizer in a LossScaleOptimizer, so a step whose
gradients overflow on one rank only must be skipped on every rank), and Horovod's
keyword arguments (``sparse_as_dense``, ``local_variables``, ``device``).

One 2-rank world (Keras costs seconds to import per process); Keras is imported only
in the rank processes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from ringtest import run_scenarios, run_world

if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras 3 is not installed (pip install 'ringtrain[keras]')", allow_module_level=True)

N = 2
STEPS = 4  # fit steps; rank 1's second batch overflows float16 at the initial loss scale


def _fit(hvd: Any, keras: Any, explicit: bool) -> dict[str, Any]:
    import numpy as np

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4),
                                  keras.layers.Dense(1, dtype="float32")])
        inner = keras.optimizers.SGD(0.01)
        # explicit: the exchange runs first, on the scaled gradients (the reference);
        # auto: compile wraps the DistributedOptimizer, whose exchange runs after the check.
        opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(inner) if explicit else inner)
        model.compile(optimizer=opt, loss="mse")
        x = np.ones((2 * STEPS, 3), "float32")
        if hvd.rank() == 1:
            x[2:4] = 3e4
        y = np.zeros((2 * STEPS, 1), "float32")
        for _ in range(2):  # a second fit: ranks out of step would pair unrelated exchanges
            model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
        o = model.optimizer
        return {"wrapped": type(o).__name__, "iterations": int(o.iterations),
                "scale": float(o.dynamic_scale), "weights": [w.tolist() for w in model.get_weights()]}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _horovod_keywords(hvd: Any, keras: Any) -> dict[str, Any]:
    """Ranks start from different weights; the bias of the last layer is local."""
    import numpy as np

    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.0), name="opt", device_dense="",
                                   device_sparse="", sparse_as_dense=True)
    model.compile(optimizer=opt, loss="mse")
    local = model.layers[-1].bias
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0, device="", local_variables=local),
                 hvd.callbacks.MetricAverageCallback(device="")]
    local.assign(np.full((1,), float(hvd.rank()), "float32"))
    model.fit(np.ones((2, 3), "float32"), np.zeros((2, 1), "float32"), batch_size=2, verbose=0,
              callbacks=callbacks)
    return {"kernel": model.layers[0].kernel.numpy().tolist(), "local": float(local.numpy()[0])}


def _horovod_keras_script(directory: str) -> dict[str, Any]:
    import ringtrain.keras as hvd  # noqa: I001 - first: it selects Keras' torch backend

    import keras
    import numpy as np

    hvd.init()
    out: dict[str, Any] = {"who": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())}
    out["avg"] = float(hvd.allreduce(float(hvd.rank()), name="r"))
    out["sum"] = float(hvd.allreduce(np.array([1.0, 2.0]), average=False)[1])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x = np.ones((4, 3), dtype="float32") * (hvd.rank() + 1)
    model.fit(x, np.zeros((4, 1), dtype="float32"), epochs=1, verbose=0)
    path = Path(directory) / "m.keras"
    if hvd.rank() == 0:
        model.save(path)
    hvd.allreduce(0.0, name="saved")  # every rank waits until rank 0 saved
    loaded = hvd.load_model(path)
    out["loaded_distributed"] = hasattr(loaded.optimizer, "exchange")
    out["iterations_kept"] = int(loaded.optimizer.iterations.numpy())
    loaded.fit(x, np.zeros((4, 1), dtype="float32"), epochs=1, verbose=0)
    out["weights"] = [w.tolist() for w in loaded.get_weights()]
    return out


def _world(directory: str) -> dict[str, Any]:
    import ringtrain.keras as hvd

    keras = hvd.load_keras()
    hvd.init()
    # The reference first: with the defect the auto-wrapped ranks leave step.
    return run_scenarios([("api", lambda: _horovod_keras_script(directory)),
                          ("keywords", lambda: _horovod_keywords(hvd, keras)),
                          ("explicit", lambda: _fit(hvd, keras, True)),
                          ("auto", lambda: _fit(hvd, keras, False))])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(_world, N, str(tmp_path_factory.mktemp("keras")), timeout=140)


@pytest.mark.timeout(150)
def test_horovod_keras_calls_and_load_model(world: list[dict[str, Any]]) -> None:
    r0, r1 = (w["api"] for w in world)
    assert isinstance(r0, dict) and isinstance(r1, dict), (r0, r1)
    assert r0["who"] == (0, 2, 0, 2) and r1["who"] == (1, 2, 1, 2)
    for o in (r0, r1):
        assert o["avg"] == 0.5 and o["sum"] == 4.0
        assert o["loaded_distributed"] and o["iterations_kept"] == 1
    assert r0["weights"] == r1["weights"], "the loaded optimizer still averages gradients"


@pytest.mark.timeout(120)
def test_auto_loss_scaling_skips_an_overflowing_step_on_every_rank(world: list[dict[str, Any]]) -> None:
    r0, r1 = world
    for label in ("explicit", "auto"):
        assert isinstance(r0[label], dict), r0[label]
        assert isinstance(r1[label], dict), r1[label]
        assert r0[label]["wrapped"] == "LossScaleOptimizer"
        assert r0[label] == r1[label], f"{label}: ranks diverged"
    # Rank 1's overflow skipped the step everywhere (the scale halved on both ranks), and
    # the auto-wrapped run trains as the explicit one does.
    assert r0["auto"]["iterations"] < 2 * STEPS
    assert r0["auto"] == r0["explicit"]


@pytest.mark.timeout(120)
def test_horovod_keyword_arguments_and_local_variables(world: list[dict[str, Any]]) -> None:
    r0, r1 = (w["keywords"] for w in world)
    assert isinstance(r0, dict) and isinstance(r1, dict), (r0, r1)
    assert r0["kernel"] == r1["kernel"], "the broadcast skipped a variable that is not local"
    assert (r0["local"], r1["local"]) == (0.0, 1.0), "a local variable was broadcast"
