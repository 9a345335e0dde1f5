"""``run_calibration_in_job`` on 2 real ranks (Gloo on loopback): rank 0 gets the fit and
a prediction of the measured step, the other rank None, and the script's world stays up."""

from __future__ import annotations

from typing import Any

import pytest
from ringtest import run_world


def _calibrate() -> Any:
    from ringtrain import runtime
    from ringtrain.errors import ConfigError
    from ringtrain.plan.calibrate import run_calibration_in_job

    try:
        cal = run_calibration_in_job(sizes=(4096, 1 << 20, 4 << 20), iters=3, steps=6, warmup=1)
    except ConfigError as err:  # a sweep that noise flattened: the test decides
        return {"error": str(err), "still_up": runtime.is_initialized()}
    return {"cal": cal, "still_up": runtime.is_initialized()}


@pytest.mark.timeout(300)
def test_calibration_in_a_job_fits_its_links_and_predicts_its_step() -> None:
    # A loose ratio (no absolute time): it catches a broken model (compute left out, bits
    # for bytes: 8x and more), not machine noise. Beside a busy loop on the 2-core CI
    # machine, 3 steps and 2 sweep iterations gave 0.89-1.85 in 6 runs and once over 2.0
    # in a fresh-clone run; with 6 steps and 3 iterations 0.96-1.84 in 8 runs. Once in a
    # fresh-clone run a stalled VM made the 3-point sweep show no growth with size (the
    # fit then refuses, rightly). So up to 3 jobs: a broken model fails every one of
    # them, noise not three times in a row.
    seen = []
    for _ in range(3):
        got = run_world(_calibrate, 2, timeout=80)
        assert got[0]["still_up"] and got[1]["still_up"]
        if "error" in got[0]:
            assert "no growth with message size" in got[0]["error"], got[0]["error"]
            seen.append(got[0]["error"])
            continue
        assert got[1]["cal"] is None
        cal = got[0]["cal"]
        assert [p.world for p in cal.sweep] == [2, 2, 2] and not cal.link_on_cpu
        assert cal.fit.bandwidth > 0
        check = cal.checks[0]
        ratio = check.predicted_inworld_s / check.measured_s
        if 1 / 3 < ratio < 3.0:
            return
        seen.append(f"predicted/measured {ratio:.2f} ({check.predicted_inworld_s}, {check.measured_s})")
    pytest.fail(f"3 calibrations in a row out of bounds: {seen}")
