"""``import ringtrain.keras as hvd`` offers horovod.keras's module calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ringtest import run_world


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


@pytest.mark.timeout(150)
def test_horovod_keras_calls_and_load_model(tmp_path: Path) -> None:
    r0, r1 = run_world(_horovod_keras_script, 2, str(tmp_path), timeout=140)
    assert r0["who"] == (0, 2, 0, 2) and r1["who"] == (1, 2, 1, 2)
    for o in (r0, r1):
        assert o["avg"] == 0.5 and o["sum"] == 4.0
        assert o["loaded_distributed"] and o["iterations_kept"] == 1
    assert r0["weights"] == r1["weights"], "the loaded optimizer still averages gradients"
