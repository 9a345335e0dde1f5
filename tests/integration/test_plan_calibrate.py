"""`ringtrain plan --calibrate` for real: loopback Gloo processes, fit, predict, measure."""

from __future__ import annotations

import multiprocessing

import pytest

from ringtrain.plan.calibrate import format_calibration, run_calibration


@pytest.mark.timeout(60)
def test_calibration_predicts_a_real_step_and_leaves_no_process_behind() -> None:
    # Two processes only, to stay well inside the limit on a busy 2-core machine;
    # `ringtrain plan --calibrate` also runs 4, whose arithmetic the unit tests cover.
    cal = run_calibration((2,), sizes=(4096, 1 << 20, 16 << 20), iters=3, steps=4, warmup=1, timeout_s=40.0)
    assert cal.fit.alpha_s >= 0 and cal.fit.bandwidth > 0
    assert [c.world for c in cal.checks] == [2]
    assert cal.gradient_bytes == 4 * 1_199_882  # the MNIST CNN's parameters, fp32
    for check in cal.checks:
        # Timings are compared as ratios in one run, never as absolute times. The
        # loose bound catches a broken model (a missing term, bits for bytes: 8x), not
        # the noise of a loaded machine.
        assert 1 / 5 < check.predicted_inworld_s / check.measured_s < 5.0, format_calibration(cal)
        assert check.predicted_inworld_s > check.inworld_compute_s  # the exchange costs something
    assert multiprocessing.active_children() == []
