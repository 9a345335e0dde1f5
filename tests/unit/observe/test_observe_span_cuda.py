"""span("h2d_copy") on CUDA: a blocking copy waits for the compute queued before it, so
the span starts after the current stream is drained (torch.cuda replaced by recorders)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ringtrain import events
from ringtrain.observe import span


class _Stream:
    def __init__(self) -> None:
        self.synced_at: list[float] = []

    def synchronize(self) -> None:
        time.sleep(0.01)  # the previous step's kernels, still queued
        self.synced_at.append(time.perf_counter())


@pytest.fixture()
def stream(monkeypatch: pytest.MonkeyPatch) -> _Stream:
    s = _Stream()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: s)
    return s


@pytest.fixture()
def seen() -> Iterator[list[tuple[str, float, float]]]:
    got: list[tuple[str, float, float]] = []

    def listen(kind: str, a: float, b: float, info: dict[str, Any]) -> None:
        got.append((kind, a, b))

    events.subscribe(listen)
    yield got
    events.unsubscribe(listen)


def test_a_copy_span_starts_after_the_queued_compute(stream: _Stream, seen: list) -> None:
    with span("h2d_copy"):
        pass
    (kind, a, b), = seen
    assert kind == "h2d_copy" and len(stream.synced_at) == 1
    assert stream.synced_at[0] <= a and b - a < 0.01  # the drain is not in the copy's time


def test_other_spans_and_unmetered_copies_do_not_synchronise(stream: _Stream) -> None:
    assert not events.active()
    with span("h2d_copy"):  # no listener: nothing is timed, nothing waits
        pass
    got: list[str] = []

    def listen(kind: str, a: float, b: float, info: dict[str, Any]) -> None:
        got.append(kind)

    events.subscribe(listen)
    try:
        with span("update"):
            pass
    finally:
        events.unsubscribe(listen)
    assert got == ["update"] and stream.synced_at == []


class _Mark:
    """A CUDA event of the step timer: ``done`` as the device says, ``device`` where recorded."""

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.done = True
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: _Mark) -> float:
        if not (self.done and other.done) or self.device != other.device:
            raise RuntimeError("CUDA error: device not ready")  # as torch.cuda.Event does
        return (other.t - self.t) * 1e3


def test_the_step_timer_never_raises_into_the_loop() -> None:
    from ringtrain.observe.gpu import DeviceStepTimer

    marks: list[_Mark] = []

    def factory() -> _Mark:
        marks.append(_Mark(device=len(marks) % 2 if len(marks) >= 2 else 0))
        return marks[-1]

    timer = DeviceStepTimer(factory)
    timer.data_ready()
    marks[0].done = False  # the batch mark is on a stream the device has not reached yet
    timer.step_end(0)  # the end mark is done: reading the pair now was CUDA's error
    assert list(timer.times) == []
    marks[0].done = True
    timer.poll()
    assert [i for i, _ in timer.times] == [0]
    timer.data_ready()  # on device 0 ...
    timer.step_end(1)  # ... and device 1: no elapsed time between them, the step is dropped
    assert [i for i, _ in timer.times] == [0] and not timer._pending
