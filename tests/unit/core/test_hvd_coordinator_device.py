"""The coordinator's cycle thread runs on this process's GPU, not on cuda:0.

CUDA's current device is per thread, and a new thread starts on device 0. The cycle
thread runs the NCCL operations and makes a joined rank's zeros on
``torch.cuda.current_device()``: without its own ``set_device`` those went to GPU 0 on
every local rank. No GPU here: ``torch.cuda.set_device`` is recorded, not called.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ringtrain import inflight
from ringtrain.horovod import basics
from ringtrain.horovod._coordinator import engine as engine_mod


def _engine(monkeypatch: pytest.MonkeyPatch, device: torch.device | None) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(engine_mod.dist, "new_group", lambda *a, **k: object())
    monkeypatch.setattr(inflight, "gather_objects", lambda obj, group=None, device=None: [obj])
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda dev: calls.append((threading.current_thread().name, dev)))
    eng = engine_mod.Engine(0, 1, None, fusion_bytes=1 << 20, stall_timeout=None,
                            cuda_backend="nccl" if device is not None else None, device=device)
    eng.shutdown(timeout=10.0)
    assert not eng._thread.is_alive()
    return calls


def test_the_cycle_thread_pins_the_processs_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _engine(monkeypatch, torch.device("cuda", 3))
    assert calls == [("ringtrain-coordinator", torch.device("cuda", 3))]


def test_a_cpu_process_pins_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _engine(monkeypatch, None) == []
    assert _engine(monkeypatch, torch.device("cpu")) == []


def test_hvd_init_hands_the_worlds_device_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringtrain.settings import load_settings

    class Built(Exception):
        pass

    seen: dict[str, Any] = {}

    def fake_engine(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise Built

    world = SimpleNamespace(env=SimpleNamespace(rank=1, size=2), backend="nccl",
                            device=torch.device("cuda", 1), settings=load_settings())
    monkeypatch.setattr(basics.wiring, "init", lambda: world)
    monkeypatch.setattr(basics, "Engine", fake_engine)
    monkeypatch.setattr(basics, "_engine", None)
    with pytest.raises(Built):
        basics.init()
    assert seen["device"] == torch.device("cuda", 1)
    assert seen["cuda_backend"] == "nccl"


class _FakeStream:
    def __init__(self, log: list[tuple[Any, ...]], device: torch.device) -> None:
        self.log, self.device = log, device
        self.thread = threading.current_thread().name

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append(("wait", self.thread, self.device, event.id))


class _FakeEvent:
    count = 0

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        _FakeEvent.count += 1
        self.id, self.log = _FakeEvent.count, log

    def record(self, stream: _FakeStream) -> None:
        self.log.append(("record", stream.thread, stream.device, self.id))


def test_cuda_operations_are_ordered_with_the_callers_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # Streams are per thread: the coordinator's stream waits for the point where the
    # script submitted (a tensor written on a side stream), and the script's stream
    # waits for the end of the operation on the coordinator's (Horovod's ready event,
    # NCCL's work.wait()). The log says which thread's stream did what, in order.
    log: list[tuple[Any, ...]] = []
    monkeypatch.setattr(engine_mod.dist, "new_group", lambda *a, **k: object())
    monkeypatch.setattr(inflight, "gather_objects", lambda obj, group=None, device=None: [obj])
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream(log, device))
    monkeypatch.setattr(torch.cuda, "Event", lambda: _FakeEvent(log))

    def run_op(self: Any, kind: str, group: Any, items: Any, mine: Any) -> list[Any]:
        log.append(("op", threading.current_thread().name))
        return ["result" for _ in mine]

    monkeypatch.setattr(engine_mod.Engine, "_run_op", run_op)
    gpu = torch.device("cuda", 1)
    eng = engine_mod.Engine(0, 1, None, fusion_bytes=1 << 20, stall_timeout=10.0,
                            cuda_backend="nccl", device=gpu)
    try:
        meta = engine_mod.Meta("broadcast.x", "broadcast", 0, dtype="float32", shape=(2,), root=0,
                               device="cuda")
        request = engine_mod.Request(meta, SimpleNamespace(device=gpu))  # type: ignore[arg-type]
        handle = eng.submit(meta, request)
        assert handle.wait() == "result"
    finally:
        eng.shutdown(timeout=10.0)
    main, coord = threading.current_thread().name, "ringtrain-coordinator"
    ready, done = log[0][3], log[3][3]
    assert log == [("record", main, gpu, ready), ("wait", coord, gpu, ready), ("op", coord),
                   ("record", coord, gpu, done), ("wait", main, gpu, done)]


def test_cpu_operations_touch_no_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_mod.dist, "new_group", lambda *a, **k: object())
    monkeypatch.setattr(inflight, "gather_objects", lambda obj, group=None, device=None: [obj])

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("no CUDA call for a CPU tensor")

    monkeypatch.setattr(torch.cuda, "current_stream", refuse)
    monkeypatch.setattr(torch.cuda, "Event", refuse)
    monkeypatch.setattr(engine_mod.Engine, "_run_op", lambda self, kind, group, items, mine: [7])
    eng = engine_mod.Engine(0, 1, None, fusion_bytes=1 << 20, stall_timeout=10.0)
    try:
        meta = engine_mod.Meta("broadcast.y", "broadcast", 0, dtype="float32", shape=(2,), root=0)
        assert eng.submit(meta, engine_mod.Request(meta, torch.zeros(2))).wait() == 7
    finally:
        eng.shutdown(timeout=10.0)
