"""The step meter: phase split, step assembly, rolling statistics, and the 5% sum check."""

from __future__ import annotations

import pytest

from ringtrain import events
from ringtrain.observe.meter import PHASES, Meter, split_step, summarize


def test_split_without_overlap_fills_the_gaps_with_compute() -> None:
    totals, segments = split_step(0.0, 10.0, [("data_wait", 0.0, 3.0), ("exchange_wait", 7.0, 8.0),
                                              ("update", 8.0, 9.0)])
    assert totals == pytest.approx({"data_wait": 3.0, "h2d_copy": 0.0, "compute": 5.0,
                                    "exchange_wait": 1.0, "update": 1.0})
    assert [s[0] for s in segments] == ["data_wait", "compute", "exchange_wait", "update", "compute"]
    assert sum(totals.values()) == pytest.approx(10.0)


def test_split_resolves_overlaps_by_priority_and_clips_to_the_step() -> None:
    # A copy reported inside the loader's wait is the copy; a span sticking out of the
    # step is cut at its edges; two data waits overlapping count once.
    spans = [("data_wait", -2.0, 4.0), ("h2d_copy", 3.0, 5.0), ("data_wait", 1.0, 2.0),
             ("update", 9.0, 12.0)]
    totals, segments = split_step(0.0, 10.0, spans)
    assert totals["data_wait"] == pytest.approx(3.0)
    assert totals["h2d_copy"] == pytest.approx(2.0)
    assert totals["update"] == pytest.approx(1.0)
    assert totals["compute"] == pytest.approx(4.0)
    assert sum(totals.values()) == pytest.approx(10.0)
    ends = [(a, b) for _, a, b in segments]
    assert ends[0][0] == 0.0 and ends[-1][1] == 10.0
    assert all(ends[i][1] == ends[i + 1][0] for i in range(len(ends) - 1))


def _step(meter: Meter, t: float, data: float, compute: float, xwait: float, upd: float,
          samples: int | None = 8, nbytes: int = 1000) -> float:
    """Feed one step starting at ``t``; returns its end."""
    meter.feed("data_wait", t, t + data, {"samples": samples, "batch": 0, "batches": 10})
    t += data
    meter.feed("exchange", t + compute / 2, t + compute + xwait, {"name": "b0", "bytes": nbytes})
    t += compute
    meter.feed("exchange_wait", t, t + xwait, {})
    t += xwait
    meter.feed("update", t, t + upd, {})
    t += upd
    meter.feed("step_end", t, t, {})
    return t


def test_meter_assembles_steps_and_leaves_warmup_out() -> None:
    meter = Meter(window=10, warmup=1)
    t = _step(meter, 0.0, data=5.0, compute=1.0, xwait=1.0, upd=1.0)  # warm-up: odd numbers
    for _ in range(4):
        t = _step(meter, t, data=0.2, compute=0.5, xwait=0.2, upd=0.1)
    assert meter.steps_seen == 5 and meter.measured == 4
    s = meter.summary()
    assert s["steps"] == 4
    assert s["step_s"]["mean"] == pytest.approx(1.0)
    assert s["shares"] == pytest.approx({"data_wait": 0.2, "h2d_copy": 0.0, "compute": 0.5,
                                         "exchange_wait": 0.2, "update": 0.1})
    assert s["device_busy"]["mean"] == pytest.approx(0.6)
    assert s["samples_per_s"] == pytest.approx(8.0)
    assert s["exchange"]["bytes_per_step"] == 1000
    # In flight from mid-compute to the end of the wait: 0.25 + 0.2; 0.2 of it exposed.
    assert s["exchange"]["in_flight_s"] == pytest.approx(0.45)
    assert s["exchange"]["hidden_share"] == pytest.approx(1 - 0.2 / 0.45)
    assert len(meter.series) == 5 and meter.series[0].data_wait == pytest.approx(5.0)


def test_window_rolls_and_all_scope_keeps_everything() -> None:
    meter = Meter(window=3, warmup=0)
    t = 0.0
    for data in (1.0, 1.0, 0.0, 0.0, 0.0):
        t = _step(meter, t, data=data, compute=1.0, xwait=0.0, upd=0.0)
    assert meter.shares()["data_wait"] == pytest.approx(0.0)  # the last three steps
    assert meter.summary("all")["shares"]["data_wait"] == pytest.approx(2.0 / 7.0)
    with pytest.raises(ValueError, match="scope"):
        meter.summary("month")


def test_unknown_batch_sizes_give_no_samples_rate() -> None:
    meter = Meter(warmup=0)
    _step(meter, 0.0, 0.1, 0.1, 0.0, 0.0, samples=None)
    assert meter.samples_per_s() is None and meter.summary()["samples_per_s"] is None


def test_without_step_end_a_batch_request_starts_the_next_step() -> None:
    # A loop with rt.data.Loader but no DistributedOptimizer.
    meter = Meter(warmup=0)
    done = [meter.feed("data_wait", t, t + 0.25, {"samples": 4}) for t in (0.0, 1.0, 2.0)]
    assert done[0] is None
    assert [r.step for r in done[1:] if r] == pytest.approx([1.0, 1.0])
    assert meter.shares()["data_wait"] == pytest.approx(0.25)


def test_series_is_capped_by_halving() -> None:
    meter = Meter(warmup=0, series_cap=8)
    t = 0.0
    for _ in range(40):
        t = _step(meter, t, 0.0, 0.01, 0.0, 0.0)
    assert len(meter.series) < 8
    indices = [r.index for r in meter.series]
    assert indices == sorted(indices) and indices[0] == 0
    assert len({b - a for a, b in zip(indices, indices[1:], strict=False)}) == 1  # evenly spaced


def test_empty_summary_is_plain_zeros() -> None:
    s = summarize([])
    assert s["steps"] == 0 and s["time_s"] == 0.0 and s["samples_per_s"] is None
    assert set(s["shares"]) == set(PHASES)


def test_phases_through_the_event_bus_account_for_the_whole_loop() -> None:
    """Spans sent through the real event bus (on a scripted clock, so a loaded machine
    cannot move the numbers): the phases add up to the loop's wall time, each step's
    gap between spans is compute."""
    meter = Meter(warmup=0)

    def listen(kind: str, a: float, b: float, info: dict) -> None:
        meter.feed(kind, a, b, info)

    events.subscribe(listen)
    plan = (("data_wait", 0.010), ("compute", 0.015), ("exchange_wait", 0.005), ("update", 0.004))
    try:
        steps, t = 6, 100.0
        t_begin = t
        for _ in range(steps):
            for phase, length in plan:
                if phase != "compute":
                    events.emit(phase, t, t + length, **({"samples": 4} if phase == "data_wait" else {}))
                t += length
            events.emit("step_end", t, t)
        wall = t - t_begin
    finally:
        events.unsubscribe(listen)
    records = meter.series
    assert len(records) == steps
    accounted = sum(sum(r.phase(p) for p in PHASES) for r in records)
    assert accounted == pytest.approx(sum(r.step for r in records), rel=1e-9)
    assert accounted == pytest.approx(wall, rel=1e-9)
    for phase, length in plan:
        assert [r.phase(phase) for r in records] == pytest.approx([length] * steps), phase
