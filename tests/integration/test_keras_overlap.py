"""ringtrain.keras starts bucket exchanges during backward, with the same result as after it.

One 2-rank world trains the same model from the same start with ``overlap=True`` and
``overlap=False`` (several buckets, native and ring, 1 and 2 passes per step) and records,
for every bucket launch, whether ``apply`` had started yet. Keras is imported only in the
rank processes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from ringtest import run_world

if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras 3 is not installed (pip install 'ringtrain[keras]')", allow_module_level=True)

N, B, STEPS = 2, 8, 6
CASES = [("native", 1), ("ring", 1), ("native", 2)]


def _train(rt: Any, rtk: Any, keras: Any, strategy: str, passes: int, overlap: bool) -> dict[str, Any]:
    from ringtrain import sync

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(32, activation="tanh"),
                              keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(3)])
    events: list[tuple[int, bool]] = []  # (step, launched before apply reached the exchange)
    state = {"in_apply": False, "step": 0}
    inner = sync.make_strategy(strategy)

    def recording(flat: Any, op: Any, name: Any) -> Any:
        events.append((state["step"], not state["in_apply"]))
        return inner(flat, op, name)

    # 1 KB buckets: each Dense layer's kernel in its own bucket, so there are several.
    opt = rtk.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), fusion_mb=1 / 1024,
                                   backward_passes_per_step=passes, overlap=overlap)
    opt.exchange._algorithm = recording  # the same exchange, with a probe in front
    reduce = opt.exchange.reduce

    def probed(*args: Any, **kwargs: Any) -> Any:
        state["in_apply"] = True
        try:
            return reduce(*args, **kwargs)
        finally:
            state["in_apply"] = False
            state["step"] += 1

    opt.exchange.reduce = probed
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(rt.rank())
    x = rng.standard_normal((STEPS * B, 6)).astype("float32")
    y = rng.standard_normal((STEPS * B, 3)).astype("float32")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[rtk.BroadcastGlobalVariablesCallback(0)])
    return {"weights": model.get_weights(), "events": events, "buckets": len(opt.exchange._fusion.buckets)}


def _world() -> dict[str, Any]:
    import ringtrain as rt
    import ringtrain.keras as rtk

    keras = rtk.load_keras()
    return {f"{s}-{k}-{o}": _train(rt, rtk, keras, s, k, o) for s, k in CASES for o in (True, False)}


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, N, timeout=110)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,passes", CASES)
def test_overlap_gives_the_same_weights_as_exchanging_after_backward(
        world: list[dict[str, Any]], strategy: str, passes: int) -> None:
    for rank in world:
        got, want = rank[f"{strategy}-{passes}-True"], rank[f"{strategy}-{passes}-False"]
        for a, b in zip(got["weights"], want["weights"], strict=True):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(world[0][f"{strategy}-{passes}-True"]["weights"],
                    world[1][f"{strategy}-{passes}-True"]["weights"], strict=True):
        np.testing.assert_array_equal(a, b)  # and the ranks agree


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,passes", CASES)
def test_buckets_start_before_apply_from_the_second_exchange_on(
        world: list[dict[str, Any]], strategy: str, passes: int) -> None:
    for rank in world:
        on, off = rank[f"{strategy}-{passes}-True"], rank[f"{strategy}-{passes}-False"]
        assert on["buckets"] >= 3
        assert not any(early for _, early in off["events"])  # after backward: all in apply
        first = passes - 1  # the step of the first exchange
        assert not any(early for step, early in on["events"] if step == first)
        later = [early for step, early in on["events"] if step > first]
        assert later and sum(later) >= len(later) - (STEPS // passes - 1)  # all but the last each step
