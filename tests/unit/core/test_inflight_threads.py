"""ringtrain.inflight (threads): the threads joined at exit, and the exit that a thread which
cannot finish turns into status 1 instead of an abort."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ringtrain import inflight


def test_settle_joins_threads_that_finish_and_names_those_that_do_not() -> None:
    release = threading.Event()
    quick = inflight.track(threading.Thread(target=time.sleep, args=(0.2,), name="quick"))
    stuck = inflight.track(threading.Thread(target=release.wait, name="stuck", daemon=True))
    quick.start()
    stuck.start()
    try:
        t0 = time.monotonic()
        assert inflight.settle(1.0) == ["stuck"]
        assert not quick.is_alive()  # joined, not merely waited past
        assert 0.9 <= time.monotonic() - t0 < 5.0  # the bound is for all threads together
    finally:
        release.set()
        stuck.join(5)
    assert inflight.settle(1.0) == []


@pytest.mark.timeout(60)
def test_exit_with_a_thread_that_cannot_finish_is_status_1_with_a_message() -> None:
    script = textwrap.dedent("""
        import threading, time
        import ringtrain as rt
        from ringtrain import inflight
        rt.init()
        t = threading.Thread(target=time.sleep, args=(120,), name="ringtrain-test", daemon=True)
        inflight.track(t).start()
        print("leaving", flush=True)
    """)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=50, env={**os.environ, "RINGTRAIN_STALL_TIMEOUT": "3"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert "leaving" in res.stdout
    assert ("ringtrain: thread(s) ringtrain-test still inside a backend call at exit after 5 s"
            in res.stderr), res.stderr
    assert time.monotonic() - t0 < 40  # the 5 s bound, plus start-up on a loaded machine


@pytest.mark.timeout(60)
def test_exit_with_every_thread_finished_keeps_the_scripts_status() -> None:
    script = textwrap.dedent("""
        import sys, threading, time
        import ringtrain as rt
        from ringtrain import inflight
        rt.init()
        inflight.track(threading.Thread(target=time.sleep, args=(0.5,), daemon=True)).start()
        sys.exit(3)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert res.returncode == 3, res.stdout + res.stderr
    assert "still inside" not in res.stderr
