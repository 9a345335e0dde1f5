"""ringtrain.keras on real Gloo processes: equivalence, broadcast, metrics, warmup, checkpoints, data.

Importing Keras costs seconds per process, so one 2-rank world runs every scenario
(module-scoped fixture) and each test checks its part of the results. Keras is only
imported in the rank processes, never in the pytest process.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ringtest import run_world

if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras 3 is not installed (pip install 'ringtrain[keras]')", allow_module_level=True)

N = 2            # ranks
B = 4            # rows per fit step on each rank
STEPS = 4        # fit steps per epoch on each rank
EPOCHS = 2
FEATURES, OUTPUTS = 6, 3


def _global_data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return (rng.standard_normal((rows, FEATURES)).astype("float32"),
            rng.standard_normal((rows, OUTPUTS)).astype("float32"))


def _rank_rows(rank: int, passes: int) -> np.ndarray:
    """Row indices rank ``rank`` trains on, in order: global update u uses rows
    [u*N*passes*B, (u+1)*N*passes*B), rank r's passes in rank order."""
    updates = STEPS // passes
    rows = []
    for u in range(updates):
        base = u * N * passes * B
        for p in range(passes):
            start = base + (rank * passes + p) * B
            rows.extend(range(start, start + B))
    return np.array(rows)


def _dense_model(keras: Any, seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(OUTPUTS)])


def _make_optimizer(keras: Any, kind: str) -> Any:
    if kind == "sgd":
        return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    return keras.optimizers.Adam(learning_rate=0.01)


def _equivalence(rt: Any, rtk: Any, keras: Any, passes: int, kind: str) -> dict[str, Any]:
    """Train on this rank's rows with different initial weights per rank; rank 0 also
    trains the one-process reference on all rows with batch N*passes*B."""
    x, y = _global_data(N * STEPS * B)
    initial = [w.copy() for w in _dense_model(keras, seed=0).get_weights()]  # rank 0's start
    model = _dense_model(keras, seed=rt.rank())  # differs on purpose: broadcast must fix it
    started_different = any(not np.array_equal(a, b) for a, b in zip(initial, model.get_weights(), strict=True))
    # The reference's loss is the mean over N*passes*B rows: average the summed passes.
    opt = rtk.DistributedOptimizer(_make_optimizer(keras, kind), backward_passes_per_step=passes,
                                   average_aggregated_gradients=passes > 1)
    model.compile(optimizer=opt, loss="mse")

    raw: list[dict[str, float]] = []
    after_broadcast: list[list[np.ndarray]] = []

    class Probe(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            after_broadcast.append([w.copy() for w in self.model.get_weights()])

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            raw.append(dict(logs))  # before MetricAverageCallback averages them

    rows = _rank_rows(rt.rank(), passes)
    history = model.fit(x[rows], y[rows], batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=[rtk.BroadcastGlobalVariablesCallback(0), Probe(),
                                   rtk.MetricAverageCallback()])
    out: dict[str, Any] = {
        "weights": model.get_weights(), "initial": initial, "started_different": started_different,
        "after_broadcast": after_broadcast[0], "raw_logs": raw, "history": history.history,
        "iterations": int(opt.iterations.numpy()),
    }
    if rt.rank() == 0:
        reference = _dense_model(keras, seed=0)
        reference.set_weights(initial)
        ref_opt = _make_optimizer(keras, kind)
        reference.compile(optimizer=ref_opt, loss="mse")

        class PassCount(keras.callbacks.Callback):
            # Horovod counts every pass in `iterations`: update m runs at m * passes - 1
            # (Adam's bias correction, a schedule), where one process counts updates.
            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                ref_opt.iterations.assign(int(ref_opt.iterations) + passes - 1)

        reference.fit(x, y, batch_size=N * passes * B, epochs=EPOCHS, shuffle=False, verbose=0,
                      callbacks=[PassCount()])
        out["reference"] = reference.get_weights()
    return out


def _warmup_and_checkpoint(rt: Any, rtk: Any, keras: Any, directory: str) -> dict[str, Any]:
    x, y = _global_data(STEPS * B)
    model = _dense_model(keras, seed=10 + rt.rank())
    model.compile(optimizer=rtk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    seen: list[tuple[int, int, float, float]] = []
    restored_momentum: list[float] = []
    epoch_box = [0]

    class Probe(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            epoch_box[0] = epoch

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            opt = self.model.optimizer
            seen.append((epoch_box[0], batch, float(opt.learning_rate), float(opt.momentum)))

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            restored_momentum.append(float(self.model.optimizer.momentum))

    mine = Path(directory) / f"rank{rt.rank()}"
    warm = rtk.LearningRateWarmupCallback(0.1, warmup_epochs=1.5)
    model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[rtk.BroadcastGlobalVariablesCallback(0), warm, Probe(),
                         rtk.CheckpointCallback(mine)])
    files = sorted(p.name for p in mine.glob("*")) if mine.exists() else []

    # Every rank restores rank 0's newest checkpoint into a fresh model.
    fresh = _dense_model(keras, seed=99)
    fresh.compile(optimizer=rtk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    next_epoch = rtk.restore(fresh, Path(directory) / "rank0")
    return {"lr_seen": seen, "momentum_after_batch": restored_momentum, "files": files,
            "next_epoch": next_epoch, "trained": model.get_weights(), "restored": fresh.get_weights(),
            "restored_iterations": int(fresh.optimizer.iterations.numpy()),
            "trained_iterations": int(model.optimizer.iterations.numpy()),
            "empty_dir_epoch": rtk.restore(fresh, Path(directory) / "nothing-here")}


def _loader_shards(rt: Any, rtk: Any, keras: Any) -> dict[str, Any]:
    """fit() on a rt.data.Loader: record which sample indices this rank trained on."""
    import torch

    from ringtrain.data import Loader

    size = N * B * STEPS
    data = torch.utils.data.TensorDataset(
        torch.arange(size, dtype=torch.float32).unsqueeze(1).repeat(1, 2),
        torch.zeros(size, 1))
    seen: list[list[int]] = []

    class Recorder(keras.layers.Layer):
        def call(self, inputs: Any, training: bool = False) -> Any:
            if training and isinstance(inputs, torch.Tensor):
                seen[-1].extend(int(v) for v in inputs[:, 0].tolist())
            return inputs

    class EpochMark(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            seen.append([])

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), Recorder(), keras.layers.Dense(1)])
    model.compile(optimizer=rtk.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    loader = Loader(data, batch_size=B, shuffle=True, seed=3, num_workers=0)
    model.fit(rtk.LoaderDataset(loader), epochs=EPOCHS, verbose=0,
              callbacks=[rtk.BroadcastGlobalVariablesCallback(0), EpochMark()])
    # A resumed fit continues with the order of its initial epoch.
    model.fit(rtk.LoaderDataset(loader, initial_epoch=EPOCHS - 1), epochs=EPOCHS,
              initial_epoch=EPOCHS - 1, verbose=0, callbacks=[EpochMark()])
    # The loader's own order for the same (seed, epoch, rank, size), for comparison.
    expected = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        expected.append([int(v) for x, _ in loader for v in x[:, 0].tolist()])
    loader.close()
    return {"seen": seen, "expected": expected, "batches": len(loader)}


def _exchange_details(rt: Any, rtk: Any) -> dict[str, Any]:
    """GradientExchange on raw tensors: None gradients, partial flush, bf16, mismatch."""
    import torch

    from ringtrain.errors import MismatchError

    r = rt.rank()
    params = [torch.zeros(3), torch.zeros(2)]
    ex = rtk.GradientExchange()
    # Rank 0 has no gradient for the second tensor: it contributes zeros.
    grads = [torch.full((3,), float(r + 1)), None if r == 0 else torch.full((2,), 4.0)]
    with_none = ex.reduce(grads, params)

    acc = rtk.GradientExchange(backward_passes_per_step=3)
    first = acc.reduce([torch.full((3,), 1.0 + r), torch.ones(2)], params)
    acc.reduce([torch.full((3,), 3.0 + r), torch.ones(2)], params)
    partial = acc.flush()  # 2 of 3 passes: summed (as Horovod), then averaged over ranks
    avg = rtk.GradientExchange(backward_passes_per_step=2, average_aggregated_gradients=True)
    avg.reduce([torch.full((3,), 1.0 + r), torch.ones(2)], params)
    averaged = avg.reduce([torch.full((3,), 3.0 + r), torch.ones(2)], params)

    g = torch.randn(1000, generator=torch.Generator().manual_seed(r))
    bf16 = rtk.GradientExchange(compression=rt.Compression.bf16).reduce([g], [torch.zeros(1000)])[0]
    exact = rt.allreduce(g)

    try:
        rtk.GradientExchange().reduce([torch.ones(2 + r)], [torch.zeros(2 + r)])
        mismatch = ""
    except MismatchError as exc:
        mismatch = str(exc)
    return {"with_none": with_none, "first": first, "partial": partial, "averaged": averaged,
            "bf16_err": float((bf16 - exact).abs().max()), "bf16_dtype": str(bf16.dtype),
            "mismatch": mismatch}


def _keras_world(directory: str) -> dict[str, Any]:
    import ringtrain as rt
    import ringtrain.keras as rtk

    keras = rtk.load_keras()
    return {
        "sgd_k1": _equivalence(rt, rtk, keras, passes=1, kind="sgd"),
        "adam_k2": _equivalence(rt, rtk, keras, passes=2, kind="adam"),
        "warmup": _warmup_and_checkpoint(rt, rtk, keras, directory),
        "loader": _loader_shards(rt, rtk, keras),
        "exchange": _exchange_details(rt, rtk),
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("keras_ckpt")
    return run_world(_keras_world, N, str(directory), timeout=110)


def _assert_weights_close(got: list[np.ndarray], want: list[np.ndarray], atol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["sgd_k1", "adam_k2"])
def test_n_ranks_equal_one_rank_with_n_times_the_batch(world: list[dict[str, Any]], case: str) -> None:
    reference = world[0][case]["reference"]
    for rank in world:
        _assert_weights_close(rank[case]["weights"], reference)
    # iterations counts fit steps (passes), as Horovod's; backward_passes_per_step=2
    # updates once per 2 of them (the reference counts them the same way).
    assert world[0][case]["iterations"] == EPOCHS * STEPS


@pytest.mark.timeout(120)
def test_broadcast_callback_makes_different_initial_weights_identical(world: list[dict[str, Any]]) -> None:
    assert world[1]["sgd_k1"]["started_different"]
    for rank in world:
        _assert_weights_close(rank["sgd_k1"]["after_broadcast"], world[0]["sgd_k1"]["initial"], atol=0)


@pytest.mark.timeout(120)
def test_metric_average_callback_logs_the_mean_over_ranks(world: list[dict[str, Any]]) -> None:
    raw = [rank["sgd_k1"]["raw_logs"] for rank in world]
    assert raw[0][0]["loss"] != raw[1][0]["loss"]  # ranks saw different data
    for epoch in range(EPOCHS):
        mean = sum(r[epoch]["loss"] for r in raw) / N
        for rank in world:
            assert rank["sgd_k1"]["history"]["loss"][epoch] == pytest.approx(mean, rel=1e-6)


@pytest.mark.timeout(120)
def test_warmup_ramps_from_lr_over_size_to_lr(world: list[dict[str, Any]]) -> None:
    seen = world[0]["warmup"]["lr_seen"]
    warmup_steps = 6  # 1.5 epochs of 4 steps
    assert len(seen) == EPOCHS * STEPS
    for epoch, batch, lr, _ in seen:
        step = epoch * STEPS + batch
        want = 0.1 * (1 / N + (1 - 1 / N) * min(step + 1, warmup_steps) / warmup_steps)  # Horovod's
        assert lr == pytest.approx(want, rel=1e-6), (epoch, batch)
    # Momentum correction: momentum x new/old for the step where the rate changes...
    for (_, _, lr_prev, _), (_, _, lr, momentum) in zip(seen[1:warmup_steps], seen[2:warmup_steps + 1], strict=True):
        assert momentum == pytest.approx(0.9 * lr / lr_prev, rel=1e-6)
    assert seen[-1][3] == pytest.approx(0.9)  # ...and untouched once the rate is constant
    assert all(m == pytest.approx(0.9) for m in world[0]["warmup"]["momentum_after_batch"])


@pytest.mark.timeout(120)
def test_only_rank_0_writes_checkpoints_and_every_rank_restores_them(world: list[dict[str, Any]]) -> None:
    assert world[0]["warmup"]["files"] == ["epoch-000.ckpt", "epoch-001.ckpt"]
    assert world[1]["warmup"]["files"] == []
    trained = world[0]["warmup"]["trained"]
    for rank in world:
        out = rank["warmup"]
        assert out["next_epoch"] == EPOCHS
        assert out["empty_dir_epoch"] == 0
        _assert_weights_close(out["restored"], trained, atol=0)
        assert out["restored_iterations"] == world[0]["warmup"]["trained_iterations"]


@pytest.mark.timeout(120)
def test_fit_on_a_loader_gives_each_rank_its_own_shard(world: list[dict[str, Any]]) -> None:
    for epoch in range(EPOCHS):
        per_rank = [rank["loader"]["seen"][epoch] for rank in world]
        for rank, got in zip(world, per_rank, strict=True):
            assert got == rank["loader"]["expected"][epoch]  # the loader's order, in order
            assert len(got) == rank["loader"]["batches"] * B
        union = sorted(v for got in per_rank for v in got)
        assert union == list(range(N * B * STEPS))  # disjoint shards covering the data
    first, second = (world[0]["loader"]["seen"][e] for e in range(2))
    assert first != second  # set_epoch reshuffles
    for rank in world:  # fit(initial_epoch=...) with LoaderDataset(initial_epoch=...)
        assert rank["loader"]["seen"][EPOCHS] == rank["loader"]["expected"][EPOCHS - 1]


@pytest.mark.timeout(120)
def test_gradient_exchange_details(world: list[dict[str, Any]]) -> None:
    import torch

    for rank in world:
        out = rank["exchange"]
        torch.testing.assert_close(out["with_none"][0], torch.full((3,), 1.5))
        torch.testing.assert_close(out["with_none"][1], torch.full((2,), 2.0))
        assert out["first"] is None  # accumulating
        # Rank r's passes sum to 4 + 2r; over ranks: 5. Averaged over the passes: 2.5.
        torch.testing.assert_close(out["partial"][0], torch.full((3,), 5.0))
        torch.testing.assert_close(out["averaged"][0], torch.full((3,), 2.5))
        assert out["bf16_dtype"] == "torch.float32" and out["bf16_err"] < 2e-2
        assert "tensor #0" in out["mismatch"] and "differ" in out["mismatch"]
