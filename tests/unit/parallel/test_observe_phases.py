"""The step meter and the doctor's verdict with pipeline bubbles and FSDP traffic."""

from __future__ import annotations

from typing import Any

import pytest

from ringtrain.observe.meter import PARALLEL_PHASES, PHASES, Meter, split_step
from ringtrain.observe.verdict import diagnose, render


def test_split_gives_the_new_phases_only_when_they_occur() -> None:
    totals, _ = split_step(0.0, 10.0, [("data_wait", 0.0, 1.0)])
    assert set(totals) == set(PHASES)
    totals, segments = split_step(0.0, 10.0, [
        ("shard_comm", 1.0, 2.0), ("pipeline_bubble", 2.0, 4.0), ("pipeline_bubble", 8.0, 9.0),
        ("update", 9.0, 10.0)])
    assert totals["shard_comm"] == pytest.approx(1.0)
    assert totals["pipeline_bubble"] == pytest.approx(3.0)
    assert totals["compute"] == pytest.approx(5.0)
    assert sum(totals.values()) == pytest.approx(10.0)
    assert [s[0] for s in segments][:3] == ["compute", "shard_comm", "pipeline_bubble"]


def _meter(steps: int, bubble: float, shard: float, step: float = 0.1,
           stage: int = 0) -> Meter:
    """Steps of ``step`` seconds; the given shares waiting in the bubble / for shards."""
    meter = Meter(warmup=1)
    t = 0.0
    info = {"stages": 2, "microbatches": 8, "stage": stage}
    for _ in range(steps):
        meter.feed("data_wait", t, t + 0.001, {"samples": 4})
        if shard:
            meter.feed("shard_comm", t + 0.01, t + 0.01 + shard * step, {"bytes": 2**20})
        if bubble:
            meter.feed("pipeline_bubble", t + 0.5 * step, t + (0.5 + bubble) * step, info)
        meter.feed("update", t + 0.95 * step, t + step, {})
        meter.feed("step_end", t + step, t + step, {})
        t += step
    return meter


def _report(meter: Meter, rank: int = 0) -> dict[str, Any]:
    return {"rank": rank, "summary": meter.summary("all"), "local_size": 2,
            "cpu": {"affinity": 2, "per_rank": 1.0}, "loader": {"workers": 0, "source": "Loader"},
            "settings": {"fusion_mb": 25.0}}


def test_the_summary_carries_their_shares_and_the_pipeline() -> None:
    s = _meter(6, bubble=0.3, shard=0.2).summary("all")
    par = s["parallel"]
    assert par["pipeline_bubble"]["share"] == pytest.approx(0.3, abs=1e-6)
    assert par["shard_comm"]["share"] == pytest.approx(0.2, abs=1e-6)
    assert par["shard_bytes_per_step"] == 2**20
    assert par["pipeline"] == {"stages": 2, "microbatches": 8, "stage": 0}
    assert set(s["shares"]) == set(PHASES)  # the classic five are unchanged
    # Waiting for a neighbour or for shards leaves the device idle.
    assert s["device_busy"]["mean"] == pytest.approx(1 - 0.01 - 0.3 - 0.2, abs=1e-6)
    assert all(name in par for name in PARALLEL_PHASES)


def test_a_job_without_them_reports_zeros() -> None:
    par = _meter(3, bubble=0.0, shard=0.0).summary("all")["parallel"]
    assert par["pipeline_bubble"]["share"] == 0.0 and par["pipeline"] is None


def test_a_large_bubble_is_pipeline_bound_with_the_numbers() -> None:
    d = diagnose([_report(_meter(6, 0.30, 0.0), 0), _report(_meter(6, 0.26, 0.0, stage=1), 1)])
    assert d.verdict == "pipeline-bound" and "28%" in d.headline
    joined = " ".join(d.advice)
    assert "(p-1)/(m+p-1) = 11%" in joined and "microbatches=16 would make it 5.9%" in joined
    assert "over the schedule's own" in joined  # 28% measured against 11% by design
    text = render(d)
    assert "pipeline bubble 28%" in text
    assert any(line.endswith("shard comm  bubble") for line in text.splitlines())


def test_fsdp_traffic_is_shard_bound_named_by_the_last_to_arrive() -> None:
    d = diagnose([_report(_meter(6, 0.0, 0.40), 0), _report(_meter(6, 0.0, 0.30), 1)])
    assert d.verdict == "shard-bound" and "30%" in d.headline and "rank 1" in d.headline
    assert "1.0 MB per step" in d.advice[0] and "shard=False" in d.advice[1]
    assert "shard gather/scatter 35%" in render(d)


def test_small_shares_leave_the_classic_verdicts_alone() -> None:
    d = diagnose([_report(_meter(6, 0.05, 0.03))])
    assert d.verdict == "compute-bound"
