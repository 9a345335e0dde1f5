"""GPU sampling through NVML and CUDA-event step timing, exercised with fakes on CPU."""

from __future__ import annotations

import types
from typing import Any

import pytest

from ringtrain.observe import gpu as gpu_mod
from ringtrain.observe.gpu import DeviceStepTimer, NvmlSampler, open_nvml_sampler
from ringtrain.observe.session import Session


class FakeNvml:
    def __init__(self, utils: list[float], fail_init: bool = False) -> None:
        self.utils = list(utils)
        self.fail_init = fail_init
        self.calls = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"gpu{i}"

    def nvmlDeviceGetName(self, h: str) -> bytes:
        return b"Fake H100"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> Any:
        self.calls += 1
        u = self.utils[min(self.calls - 1, len(self.utils) - 1)]
        return types.SimpleNamespace(gpu=u, memory=0)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        return types.SimpleNamespace(used=30 * 2**30, total=80 * 2**30)


def test_sampler_summarises_utilisation_and_memory() -> None:
    clock = iter(float(i) for i in range(100))
    sampler = NvmlSampler(FakeNvml([0, 90, 0, 90, 60]), "gpu0", "Fake", clock=lambda: next(clock))
    for _ in range(5):
        sampler.sample()
    s = sampler.summary()
    assert s is not None
    assert s["util_mean"] == pytest.approx(48.0) and s["samples"] == 5
    assert s["mem_used_max"] == 30 * 2**30 and s["mem_total"] == 80 * 2**30
    assert sampler.summary(t_from=3.0)["util_mean"] == pytest.approx(75.0)  # type: ignore[index]
    assert sampler.summary(t_from=99.0) is None


def test_open_sampler_runs_a_thread_and_stops() -> None:
    sampler = open_nvml_sampler(0, interval_s=0.01, nvml=FakeNvml([50.0]))
    assert sampler is not None and sampler.name == "Fake H100"
    import time

    time.sleep(0.1)
    sampler.stop()
    assert len(sampler.samples()) >= 3


def test_no_nvml_or_a_refusing_driver_means_no_sampler() -> None:
    assert open_nvml_sampler(0, nvml=FakeNvml([1.0], fail_init=True)) is None
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert open_nvml_sampler(0) is None


class FakeEvent:
    clock = 0.0
    done_default = True

    def __init__(self) -> None:
        self.t: float | None = None
        self.done = FakeEvent.done_default

    def record(self) -> None:
        self.t = FakeEvent.clock

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.t is not None and other.t is not None
        return (other.t - self.t) * 1e3


def test_device_timer_reads_back_only_finished_steps() -> None:
    made: list[FakeEvent] = []

    def factory() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    timer = DeviceStepTimer(factory)
    FakeEvent.clock = 1.0
    timer.data_ready()
    timer.data_ready()  # a second batch in the same step (accumulation) keeps the first mark
    assert len(made) == 1
    FakeEvent.clock = 1.25
    FakeEvent.done_default = False  # the GPU has not reached the step's end yet
    timer.step_end(0)
    assert len(made) == 2 and list(timer.times) == []  # nothing read back, nothing waited for
    made[-1].done = True
    timer.poll()
    assert list(timer.times) == [(0, pytest.approx(0.25))]
    FakeEvent.done_default = True


def test_session_reports_nvml_busy_instead_of_the_host_estimate(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = NvmlSampler(FakeNvml([40.0]), "gpu0", "Fake", clock=lambda: 5.0)
    sampler.sample()
    s = Session(progress=False, warmup=0, gpu=False)
    s.sampler = sampler
    s.on_event("data_wait", 1.0, 1.5, {})
    s.on_event("step_end", 2.0, 2.0, {})
    out = s.summary()
    assert out["device_busy"]["source"] == "nvml" and out["device_busy"]["mean"] == pytest.approx(0.4)
    assert out["gpu"]["name"] == "Fake"
    assert gpu_mod.SAMPLE_INTERVAL_S <= 0.2  # NVML averages over >= 1/6 s; sample faster
