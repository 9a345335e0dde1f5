"""The doctor's verdict and advice on hand-made reports."""

from __future__ import annotations

from typing import Any

import pytest

from ringtrain.observe.verdict import BOUND_SHARE, diagnose, render


def report(rank: int = 0, step: float = 0.1, data: float = 0.0, copy: float = 0.0,
           xwait: float = 0.0, update: float = 0.02, workers: int | None = 0,
           source: str | None = "Loader", cpus: int = 8, local_size: int = 1,
           nbytes: float = 0.0, buckets: float = 1.0, hidden: float | None = None,
           fusion_mb: float = 25.0, tensors: float = 10.0) -> dict[str, Any]:
    compute = 1.0 - data - copy - xwait - update
    shares = {"data_wait": data, "h2d_copy": copy, "compute": compute,
              "exchange_wait": xwait, "update": update}
    busy = 1.0 - data - copy - xwait
    return {
        "rank": rank, "size": 1, "local_size": local_size,
        "summary": {
            "steps": 50, "steps_seen": 55, "warmup": 5,
            "step_s": {"mean": step, "p50": step, "p90": step * 1.1, "min": step, "max": step},
            "phases_s": {k: v * step for k, v in shares.items()}, "shares": shares,
            "device_busy": {"mean": busy, "p10": busy - 0.1, "p50": busy, "p90": busy + 0.05,
                            "source": "host"},
            "samples_per_s": 320.0,
            "exchange": {"bytes_per_step": nbytes, "buckets_per_step": buckets,
                         "tensors_per_step": tensors,
                         "in_flight_s": 0.0, "hidden_share": hidden},
            "gpu": None,
        },
        "cpu": {"affinity": cpus, "quota": None, "per_rank": cpus / local_size},
        "loader": {"workers": workers, "source": source},
        "settings": {"fusion_mb": fusion_mb},
    }


def test_input_bound_in_process_loading_gets_a_worker_count_within_budget() -> None:
    # 60 ms of a 100 ms step loading in the loop, 40 ms of device work:
    # 1.2 * 60 / 40 = 1.8 -> 2 workers.
    d = diagnose([report(data=0.6, workers=0, source="iterable")])
    assert d.verdict == "input-bound"
    assert "60%" in d.headline
    assert "num_workers=2" in d.advice[0] and "plain iterable" in d.advice[0]
    assert "~60.0 ms" in d.advice[0] and "~40.0 ms" in d.advice[0]
    text = render(d)
    assert text.startswith("verdict: INPUT-BOUND") and "device busy 40%" in text


def test_input_bound_with_workers_says_how_many_more_and_respects_the_budget() -> None:
    # 2 workers, still waiting 50%: a batch takes ~2 x 100 ms to make against 50 ms of
    # device work -> 1.2 * 200 / 50 = 4.8 -> 5 workers; budget 8 CPUs / 4 ranks = 2.
    d = diagnose([report(data=0.5, workers=2, cpus=8, local_size=4)])
    assert d.verdict == "input-bound"
    joined = " ".join(d.advice)
    assert "~5 workers would be needed but the budget allows 2" in joined
    assert "2 workers already use the CPU budget" in joined and "raise" not in joined
    d2 = diagnose([report(data=0.5, workers=2, cpus=16, local_size=1)])
    assert "raise num_workers from 2 to 5" in d2.advice[0]


def test_blocking_copies_get_their_own_advice() -> None:
    d = diagnose([report(data=0.1, copy=0.15, workers=4)])
    assert d.verdict == "input-bound"
    assert any("side stream" in a for a in d.advice)


def test_exchange_bound_advice_carries_the_numbers() -> None:
    mb = 64 * 2**20
    d = diagnose([report(rank=0, xwait=0.5, nbytes=mb, buckets=1, hidden=0.1),
                  report(rank=1, xwait=0.55, nbytes=mb, buckets=1, hidden=0.1)])
    assert d.verdict == "exchange-bound"
    assert "50%" in d.headline and "rank 0" in d.headline  # the last to arrive
    joined = " ".join(d.advice)
    assert "Compression.fp16" in joined and "64.0 MB" in joined and "~25.0 ms instead of 50.0 ms" in joined
    assert "lower fusion_mb to 6.25" in joined  # one bucket, barely hidden
    # Doubling the batch: 50 / (50 + 2 * 50) = 33%.
    assert "from 50% to ~33%" in joined
    # A single tensor cannot be split into buckets: no fusion advice then.
    single = diagnose([report(xwait=0.5, nbytes=mb, buckets=1, hidden=0.0, tensors=1)])
    assert not any("fusion_mb" in a for a in single.advice)


def test_an_exchange_over_half_the_step_names_diloco_with_an_h() -> None:
    # 0.8 s steps, 70% exchange: 560 ms exchange over 240 ms of the rest; the smallest H
    # whose 560 / H ms is at most 24 ms is 50 -> 240 + 11.2 = 251.2 ms per step.
    d = diagnose([report(step=0.8, xwait=0.7, update=0.01, nbytes=4.8 * 2**20, buckets=1, hidden=0.05)])
    assert d.verdict == "exchange-bound"
    first = d.advice[0]
    assert "rt.DiLoCo(model, inner_opt, outer_opt, sync_every=50)" in first
    assert "~251.2 ms instead of 800.0 ms (3.2x)" in first and "50x fewer bytes" in first
    assert "convergence" in first and "docs/lowcomm.md" in first
    # Exactly half, or less, is left to the per-step advice.
    for share in (0.5, 0.3):
        d = diagnose([report(step=0.8, xwait=share, nbytes=4.8 * 2**20, buckets=1, hidden=0.05)])
        assert d.verdict == "exchange-bound"
        assert not any("DiLoCo" in a for a in d.advice)


def test_many_small_buckets_suggest_larger_fusion() -> None:
    d = diagnose([report(xwait=0.3, nbytes=40 * 2**20, buckets=8, hidden=0.5, fusion_mb=5)])
    assert any("raise fusion_mb from 5 to 10" in a for a in d.advice)


def test_a_starved_rank_makes_the_others_wait_at_the_exchange_input_bound() -> None:
    # Rank 1 waits for data 40%; rank 0 waits 40% at the exchange *for rank 1*.
    d = diagnose([report(rank=0, xwait=0.4, nbytes=1e6), report(rank=1, data=0.4, xwait=0.02, nbytes=1e6)])
    assert d.verdict == "input-bound" and "rank 1" in d.headline


def test_compute_bound_when_both_waits_are_small() -> None:
    d = diagnose([report(data=0.03, xwait=0.05)])
    assert d.verdict == "compute-bound"
    assert f"{BOUND_SHARE:.0%}" in d.headline
    assert "busy 92%" in d.advice[0]


def test_no_reports_is_an_error() -> None:
    with pytest.raises(ValueError):
        diagnose([])
