"""A step is an optimizer update: gradient accumulation, torch optimizers, and the ETA.

Times are injected (a scripted clock through the real event bus), so the figures are
exact and a loaded machine cannot move them: 10 ms of data wait and 20 ms of compute
per batch, an update every k=4 batches.
"""

from __future__ import annotations

import io
import time
from typing import Any

import pytest

from ringtrain import events
from ringtrain.observe import session
from ringtrain.observe.meter import Meter
from ringtrain.observe.progress import Progress, format_status, status_of
from ringtrain.observe.timeline import TraceRecorder

DATA, COMPUTE, XWAIT, UPDATE = 0.010, 0.020, 0.003, 0.001
K = 4
BATCHES = 40  # per epoch


def _accumulate(feed: Any, updates: int, *, k: int = K, t: float = 100.0, epoch: int = 0,
                end: str = "step_end", first_batch: int = 0) -> float:
    """Feed ``updates`` updates of ``k`` batches each, as DistributedOptimizer with
    ``backward_passes_per_step=k`` publishes them (``end="step_end"``), or as a torch
    optimizer seen through the session's hook (``end="opt_step"``)."""
    batch = first_batch
    for _ in range(updates):
        for i in range(k):
            feed("data_wait", t, t + DATA, {"samples": 8, "batch": batch, "batches": BATCHES,
                                            "epoch": epoch})
            batch += 1
            t += DATA + COMPUTE
            if i == k - 1 and end == "step_end":
                feed("exchange", t - COMPUTE / 2, t + XWAIT, {"name": "b0", "bytes": 400})
                feed("exchange_wait", t, t + XWAIT, {})
                t += XWAIT
                # ringtrain's update runs the wrapped torch optimizer: its hook fires inside
                feed("opt_step", t + UPDATE / 2, t + UPDATE / 2, {})
                feed("update", t, t + UPDATE, {})
                t += UPDATE
                feed("step_end", t, t, {})
            elif i == k - 1:
                feed("opt_step", t, t, {})
    return t


def _meter_feed(meter: Meter) -> Any:
    return lambda kind, a, b, info: meter.feed(kind, a, b, info)


def test_an_accumulating_update_is_one_step_with_its_k_batches() -> None:
    meter = Meter(warmup=0)
    _accumulate(_meter_feed(meter), 5)
    # Five updates, not 3 short per-batch steps before the first one.
    assert meter.steps_seen == 5 and meter.retracted == 0
    step = K * (DATA + COMPUTE) + XWAIT + UPDATE
    s = meter.summary("all")
    assert s["steps"] == 5
    assert s["step_s"]["mean"] == pytest.approx(step)
    assert s["steps_per_s"] == pytest.approx(1 / step)
    assert s["samples_per_s"] == pytest.approx(K * 8 / step)
    assert s["batches_per_step"] == pytest.approx(K)
    assert s["phases_s"]["data_wait"] == pytest.approx(K * DATA)
    assert s["phases_s"]["exchange_wait"] == pytest.approx(XWAIT)
    assert s["exchange"]["buckets_per_step"] == pytest.approx(1.0)
    assert [r.batches for r in meter.series] == [K] * 5
    assert meter.seconds_per_batch() == pytest.approx(step / K)


def test_the_first_update_absorbs_the_per_batch_steps_before_it() -> None:
    meter = Meter(warmup=0)
    feed = _meter_feed(meter)
    t = _accumulate(feed, 1)
    first = meter.series[0]
    assert meter.steps_seen == 1 and meter.retracted == K - 1
    assert first.index == 0 and first.start == pytest.approx(100.0)
    assert first.batches == K and first.samples == K * 8
    assert first.data_wait == pytest.approx(K * DATA)
    assert first.step == pytest.approx(t - 100.0)
    assert meter.summary()["steps"] == 1


def test_a_torch_optimizer_update_ends_the_step_at_the_next_batch() -> None:
    # torch DDP with no_sync() accumulation: no ringtrain optimizer, only the hook's opt_step.
    meter = Meter(warmup=0)
    feed = _meter_feed(meter)
    t = _accumulate(feed, 3, end="opt_step")
    assert meter.steps_seen == 2  # the third is closed by the next batch or settle()
    assert meter.settle() is not None and meter.steps_seen == 3
    s = meter.summary("all")
    assert s["step_s"]["mean"] == pytest.approx(K * (DATA + COMPUTE))
    assert s["batches_per_step"] == pytest.approx(K)
    assert meter.series[-1].end == pytest.approx(t)
    # Two optimizers stepping on one batch (a GAN's) make one step.
    meter = Meter(warmup=0)
    for i in range(3):
        t0 = 10.0 * i
        meter.feed("data_wait", t0, t0 + 1, {"samples": 8})
        meter.feed("opt_step", t0 + 5, t0 + 5, {})
        meter.feed("opt_step", t0 + 6, t0 + 6, {})
    meter.settle()
    assert [r.step for r in meter.series] == pytest.approx([6.0, 10.0, 10.0])
    # With no batch source reporting, each update closes the previous one.
    meter = Meter(warmup=0)
    for i in range(3):
        meter.feed("opt_step", 2.0 * i, 2.0 * i, {})
    meter.settle()
    assert meter.steps_seen == 3 and [r.step for r in meter.series][1:] == [2.0, 2.0]


def test_a_loop_without_optimizer_still_steps_per_batch() -> None:
    meter = Meter(warmup=0)
    for i in range(4):
        meter.feed("data_wait", float(i), i + 0.25, {"samples": 4})
    assert meter.steps_seen == 3 and meter.settle() is None
    assert meter.summary()["batches_per_step"] == pytest.approx(1.0)


def test_the_epoch_eta_counts_batches_not_updates() -> None:
    meter = Meter(warmup=0)
    _accumulate(_meter_feed(meter), 5)  # 20 of 40 batches done
    per_batch = (K * (DATA + COMPUTE) + XWAIT + UPDATE) / K
    stats = status_of(meter)
    assert stats["eta_scope"] == "epoch"
    assert stats["eta_s"] == pytest.approx((BATCHES - 20) * per_batch)
    assert format_status(stats).endswith(" | epoch ETA 0:01")


def test_the_eta_runs_to_the_end_of_training_when_the_script_says_how_long() -> None:
    meter = Meter(warmup=0)
    feed = _meter_feed(meter)
    t = _accumulate(feed, BATCHES // K)  # epoch 0 done
    _accumulate(feed, 2, t=t, epoch=1)  # 8 batches of epoch 1
    step = K * (DATA + COMPUTE) + XWAIT + UPDATE
    per_batch = step / K
    stats = status_of(meter, epochs=90)
    assert stats["eta_scope"] == "training"
    assert stats["eta_s"] == pytest.approx((BATCHES - 8 + 88 * BATCHES) * per_batch)
    assert format_status(stats).endswith(" | training ETA 1:50")
    stats = status_of(meter, steps=100)  # updates this process makes
    assert stats["eta_s"] == pytest.approx((100 - 12) * step)
    # The bar (tqdm shows the epoch's own ETA) gets the training's.
    assert "training ETA" in format_status(stats, with_position=False)
    assert "ETA" not in format_status(status_of(meter), with_position=False)


def test_set_total_checks_its_arguments() -> None:
    try:
        session.set_total(epochs=90)
        assert session._total == {"epochs": 90, "steps": None}
        for bad in ({"epochs": 0}, {"steps": 2.5}, {"epochs": True}, {"epochs": 2, "steps": 3}):
            with pytest.raises(ValueError, match="set_total"):
                session.set_total(**bad)
    finally:
        session.set_total()
    assert session._total == {"epochs": None, "steps": None}


class _Bar:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.n, self.postfix = kwargs, kwargs["initial"], ""

    def update(self, k: int) -> None:
        self.n += k

    def reset(self, total: int | None = None) -> None:
        self.n = 0

    def set_description(self, text: str, refresh: bool = True) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def close(self) -> None:
        pass


def test_the_bar_moves_by_the_batches_of_each_update() -> None:
    bars: list[_Bar] = []
    meter = Meter(warmup=0)
    progress = Progress(io.StringIO(), tty=True, clock=lambda: 0.0,
                        bar_factory=lambda **kw: bars.append(_Bar(**kw)) or bars[-1])

    def feed(kind: str, a: float, b: float, info: Any) -> None:
        if meter.feed(kind, a, b, info) is not None:
            progress.update(meter)

    _accumulate(feed, 3)
    assert bars[0].kwargs["total"] == BATCHES and bars[0].n == 3 * K


def test_the_session_meters_torch_optimizer_updates_and_cleans_the_timeline(tmp_path: Any) -> None:
    """Through the hook the session puts on torch optimizers (called here as torch's
    step() calls it; tests/integration/test_observe_accumulation_world.py steps real
    ones): a loop whose optimizer is not ringtrain's gets a step per update; the
    timeline keeps no per-batch step spans that the first update absorbed."""
    s = session.start(progress=False, warmup=0, gpu=False, stream=io.StringIO())
    try:
        s.trace, s.timeline_path = TraceRecorder(0), str(tmp_path / "trace.json")
        from torch.optim.optimizer import _global_optimizer_post_hooks

        assert session._optimizer_stepped in _global_optimizer_post_hooks.values()
        for i in range(3 * K):
            t = time.perf_counter()  # the hook stamps the update on this clock
            events.emit("data_wait", t, t, samples=8, batch=i, batches=BATCHES)
            if i % K == K - 1:
                session._optimizer_stepped(None, (), {})
        summary = session.summary("all")  # closes the last update
        assert summary["steps"] == 3 and summary["batches_per_step"] == pytest.approx(K)
        steps = [e for e in s.trace.to_events() if e.get("cat") == "step"]
        assert [e["name"] for e in steps] == ["step 0", "step 1", "step 2"]
    finally:
        session.stop()
    # Stopped: the hook is gone with the listener.
    assert session._optimizer_hook is None


def test_an_update_closed_at_exit_writes_nothing_to_a_closed_stream() -> None:
    """The update a torch optimizer made last is closed at flush (atexit), when the
    stream may be closed already (pytest's capture): no progress line is made for it
    (an atexit traceback, "I/O operation on closed file", ended Horovod's elastic tests)."""
    stream = io.StringIO()
    s = session.start(progress=True, warmup=0, gpu=False, stream=stream)
    try:
        t = time.perf_counter()
        events.emit("data_wait", t, t, samples=8, batch=0, batches=BATCHES)
        session._optimizer_stepped(None, (), {})
        stream.close()
        s.flush()  # raised ValueError from the stream's isatty()
        assert s.meter.steps_seen == 1
    finally:
        session.stop()
