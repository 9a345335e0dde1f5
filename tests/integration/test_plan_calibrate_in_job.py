"""``run_calibration_in_job`` on 2 real ranks (Gloo on loopback): rank 0 gets the fit and
a prediction of the measured step, the other rank None, and the script's world stays up."""

from __future__ import annotations

from typing import Any

import pytest
from ringtest import run_world


def _calibrate() -> Any:
    from ringtrain import runtime
    from ringtrain.plan.calibrate import run_calibration_in_job

    # Sizes 4 KB .. 16 MB: the largest takes ~100x the smallest on loopback, so a stalled
    # moment (a VM pause made a 4 KB .. 4 MB sweep look flat once, and the fit refused it)
    # cannot hide the growth with size.
    cal = run_calibration_in_job(sizes=(4096, 1 << 20, 16 << 20), iters=3, steps=6, warmup=1)
    return {"cal": cal, "still_up": runtime.is_initialized()}


@pytest.mark.timeout(300)
def test_calibration_in_a_job_fits_its_links_and_predicts_its_step() -> None:
    got = run_world(_calibrate, 2, timeout=120)
    assert got[0]["still_up"] and got[1]["still_up"]
    assert got[1]["cal"] is None
    cal = got[0]["cal"]
    assert [p.world for p in cal.sweep] == [2, 2, 2] and not cal.link_on_cpu
    assert cal.fit.bandwidth > 0
    check = cal.checks[0]
    assert check.predicted_inworld_s > check.inworld_compute_s  # the exchange costs something
    # A ratio of two timings taken in the same job under the same load, not an absolute
    # time. The band catches a broken model (bits for bytes is 8x; a term left out), not
    # noise: beside a busy loop on the 2-core machine the ratio was 0.89-1.85 in 14 runs.
    ratio = check.predicted_inworld_s / check.measured_s
    assert 1 / 5 < ratio < 5.0, f"predicted/measured {ratio:.2f} ({check.predicted_inworld_s}, {check.measured_s})"
