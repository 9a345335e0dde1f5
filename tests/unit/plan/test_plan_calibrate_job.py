"""Calibration in a job: a real network's link is not shared with compute, the report
has one prediction, and ``ringtrain plan --calibrate`` picks the job mode from the
launcher's environment."""

from __future__ import annotations

import pytest

from ringtrain.plan import calibrate as cal_mod
from ringtrain.plan import cli
from ringtrain.plan.calibrate import (
    Calibration,
    Fit,
    StepCheck,
    SweepPoint,
    format_calibration,
    mnist_cnn,
    predict_step,
)
from ringtrain.plan.layers import from_module


def test_a_network_link_is_not_slowed_by_core_sharing() -> None:
    layers = from_module(mnist_cnn())
    fit = Fit(100e-6, 25e6, 0.0)
    _, on_cpu = predict_step(layers, fit, 4, 0.1, cores=2, shared=False)
    _, wire = predict_step(layers, fit, 4, 0.1, cores=2, shared=False, link_on_cpu=False)
    grads = 4 * sum(layer.params for layer in layers)
    ring = 2 * 3 / 4 * grads / fit.bandwidth
    assert wire < on_cpu  # loopback copies share the 2 cores with 4 ranks; a wire does not
    assert wire == pytest.approx(0.1 + ring + 6 * fit.alpha_s, rel=0.15)


def test_the_job_report_has_one_prediction_and_names_the_network() -> None:
    cal = Calibration(Fit(1e-4, 24e6, 0.04), [SweepPoint(3, 1 << 20, 0.06)],
                      [StepCheck(3, 0.3, 0.55, 0.3, 0.55, 0.5)], 0.28, 0.1, 4_799_528, 2, ["n"],
                      network="Gloo across the job's 3 ranks", link_on_cpu=False)
    text = format_calibration(cal)
    assert "Gloo across the job's 3 ranks fit" in text and "B = 24.0 MB/s" in text
    assert "+10.0%" in text  # (0.55 - 0.5) / 0.5
    assert "1-process step x core share" not in text


def test_plan_calibrate_measures_the_job_when_started_as_its_ranks(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cal_mod, "run_calibration_in_job", lambda: calls.append("job"))
    monkeypatch.setattr(cal_mod, "run_calibration", lambda: calls.append("local"))
    for var in ("RINGTRAIN_RANK", "RINGTRAIN_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert cli.main(["--calibrate"]) == 0
    assert calls == ["job"]
    assert "rank 1: calibration measured; rank 0 reports" in capsys.readouterr().out
