"""The loader's helper thread: runs work when a descriptor is readable, stops cleanly."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from ringtrain.data.ahead import Helper


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


@pytest.fixture
def pipe() -> tuple[int, int]:
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


@pytest.mark.timeout(30)
def test_work_runs_under_the_lock_when_a_descriptor_is_readable(pipe: tuple[int, int]) -> None:
    r, w = pipe
    lock = threading.Lock()
    got: list[tuple[bytes, bool]] = []

    def work() -> None:
        got.append((os.read(r, 100), lock.locked()))

    helper = Helper(lock, lambda: [r], work)
    helper.start()
    time.sleep(0.05)
    assert got == []  # nothing readable: the helper sleeps, it does not spin
    os.write(w, b"a")
    assert _until(lambda: len(got) == 1)
    assert got[0] == (b"a", True)
    helper.stop()
    assert not helper.running
    assert not [t for t in threading.enumerate() if t.name == "ringtrain-loader-helper"]


@pytest.mark.timeout(30)
def test_an_error_stops_the_helper_and_is_kept_for_the_loop(pipe: tuple[int, int]) -> None:
    r, w = pipe

    def work() -> None:
        os.read(r, 100)
        raise ValueError("worker 3 died")

    helper = Helper(threading.Lock(), lambda: [r], work)
    helper.start()
    os.write(w, b"x")
    assert _until(lambda: helper.error is not None and not helper.running)
    assert isinstance(helper.error, ValueError)
    helper.start()  # not restarted while the error waits to be raised
    assert not helper.running
    helper.stop()
    assert helper.error is None
    helper.start()
    assert helper.running
    helper.stop()


@pytest.mark.timeout(30)
def test_stop_from_the_helper_thread_itself_does_not_join_itself(pipe: tuple[int, int]) -> None:
    # A garbage-collection pass on the helper thread may finalize the loader, which
    # stops the helper from inside it.
    r, w = pipe
    box: dict[str, Helper] = {}
    done = threading.Event()

    def work() -> None:
        os.read(r, 100)
        box["h"].stop()
        done.set()

    box["h"] = helper = Helper(threading.Lock(), lambda: [r], work)
    helper.start()
    os.write(w, b"x")
    assert done.wait(5)
    assert _until(lambda: not helper.running)
    assert helper.error is None


@pytest.mark.timeout(30)
def test_a_parked_helper_ignores_the_workers_until_started_again(pipe: tuple[int, int]) -> None:
    r, w = pipe
    got: list[bytes] = []
    helper = Helper(threading.Lock(), lambda: [r], lambda: got.append(os.read(r, 100)))
    helper.start()
    helper.park()
    os.write(w, b"a")  # wakes it once: it notices the park and sleeps without reading
    time.sleep(0.1)
    os.write(w, b"b")
    time.sleep(0.1)
    assert b"".join(got) in (b"", b"a")  # at most the wake-up that found it parked
    helper.start()  # unpark
    assert _until(lambda: b"".join(got) == b"ab")
    helper.stop()
    assert not helper.running
