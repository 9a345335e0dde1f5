"""The pure parts of calibration: the alpha-beta fit and the step prediction."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.plan.calibrate import Fit, SweepPoint, fit_alpha_beta, mnist_cnn, predict_step
from ringtrain.plan.layers import from_module


def _ring(n: int, m: int, alpha: float, bw: float) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * m / bw


def test_fit_recovers_alpha_and_bandwidth() -> None:
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    points = [SweepPoint(n, m, _ring(n, m, 50e-6, 2e9)) for n in (2, 4) for m in sizes]
    fit = fit_alpha_beta(points)
    assert fit.alpha_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-6)
    assert fit.rms_rel_error < 1e-9


def test_fit_weights_small_messages() -> None:
    # 20% noise on the largest message must not wipe out alpha.
    sizes = [4096, 65536, 1 << 20, 16 << 20]
    points = [SweepPoint(2, m, _ring(2, m, 100e-6, 1e9) * (1.2 if m == sizes[-1] else 1.0)) for m in sizes]
    assert fit_alpha_beta(points).alpha_s == pytest.approx(100e-6, rel=0.3)


def test_fit_needs_two_sizes() -> None:
    with pytest.raises(ConfigError):
        fit_alpha_beta([SweepPoint(2, 4096, 1e-4)])
    with pytest.raises(ConfigError):
        fit_alpha_beta([SweepPoint(2, 4096, 1e-4), SweepPoint(2, 4096, 1e-4)])


def test_prediction_adds_the_allreduce_and_shares_cores() -> None:
    layers = from_module(mnist_cnn())
    fit = Fit(100e-6, 1e9, 0.0)
    grad = 4 * sum(layer.params for layer in layers)
    compute, step = predict_step(layers, fit, 2, 0.080, cores=2)
    assert compute == pytest.approx(0.080)
    assert step == pytest.approx(0.080 + _ring(2, grad, 100e-6, 1e9))
    # 4 processes on 2 cores: compute and copies both run at half speed.
    compute4, step4 = predict_step(layers, fit, 4, 0.080, cores=2)
    assert compute4 == pytest.approx(0.160)
    assert step4 == pytest.approx(0.160 + _ring(4, grad, 200e-6, 0.5e9))
    # An in-run compute time is taken as it is.
    assert predict_step(layers, fit, 4, 0.150, cores=2, shared=False)[0] == pytest.approx(0.150)
