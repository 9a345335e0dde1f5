"""``run_calibration_in_job`` on 2 real ranks (Gloo on loopback): rank 0 gets the fit and
a prediction of the measured step, the other rank None, and the script's world stays up."""

from __future__ import annotations

from typing import Any

import pytest
from ringtest import run_world


def _calibrate() -> Any:
    from ringtrain import runtime
    from ringtrain.plan.calibrate import run_calibration_in_job

    cal = run_calibration_in_job(sizes=(4096, 1 << 20, 4 << 20), iters=3, steps=6, warmup=1)
    return {"cal": cal, "still_up": runtime.is_initialized()}


@pytest.mark.timeout(90)
def test_calibration_in_a_job_fits_its_links_and_predicts_its_step() -> None:
    got = run_world(_calibrate, 2, timeout=80)
    assert got[1]["cal"] is None and got[0]["still_up"] and got[1]["still_up"]
    cal = got[0]["cal"]
    assert [p.world for p in cal.sweep] == [2, 2, 2] and not cal.link_on_cpu
    assert cal.fit.bandwidth > 0
    check = cal.checks[0]
    # A loose ratio (no absolute time): it catches a broken model (compute left out, bits
    # for bytes: 8x and more), not machine noise. Beside a busy loop on the 2-core CI
    # machine, 3 steps and 2 sweep iterations gave 0.89-1.85 in 6 runs and once over 2.0
    # in a fresh-clone run; with 6 steps and 3 iterations 0.96-1.84 in 8 runs.
    ratio = check.predicted_inworld_s / check.measured_s
    assert 1 / 3 < ratio < 3.0, (check.predicted_inworld_s, check.measured_s)
