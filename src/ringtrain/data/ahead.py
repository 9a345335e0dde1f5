"""A helper thread that receives and wraps batches while the training loop computes.

Why: taking a worker's answer, refilling the workers and wrapping the slot as tensors
cost the training process 0.15-0.3 ms per batch, spent between two steps with the
device idle: 2-3% of a 10 ms step (measured on 2 cores, where busy workers also evict
the interpreter's code from the caches, so this work runs several times slower than in
a quiet loop). The helper does it during the step instead.

When the helper runs matters as much. It is woken only by the workers (an answer
arrives, at some point during a step), never by the loop taking a batch: a thread
woken at the moment the loop resumes is scheduled right then, takes the CPU and the
interpreter lock from the loop, and costs more than it saves (measured: device busy
fell from 97% to 91%). When the loop finds no batch ready, it does the work itself,
as it would without a helper.

The helper and the loop never use the feed at the same time: everything the helper
does runs under the feed's lock, which the loop takes too.

In a loop with no step between batches (only counting samples, say) the loop always
waits for the workers itself and the helper could only wake for answers the loop is
already waiting for: that costs CPU (measured: the training process's share per image
rose from 0.8 to 1.3 us) and buys nothing. The feed then *parks* the helper: it sleeps
without watching the workers until the loop takes time between batches again.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable

__all__ = ["Helper"]

log = logging.getLogger("ringtrain.data")


class Helper:
    """Runs ``work()`` under ``lock`` whenever one of ``fds()`` becomes readable."""

    def __init__(self, lock: threading.Lock, fds: Callable[[], list[int]],
                 work: Callable[[], None]) -> None:
        self._lock = lock
        self._fds = fds
        self._work = work
        self._thread: threading.Thread | None = None
        self._stop = False
        self._parked = False
        self._park_cond = threading.Condition()
        self._wake_r = self._wake_w = -1
        #: What ``work()`` raised; the helper stopped there and the loop re-raises it.
        self.error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def park(self) -> None:
        """Stop watching the workers until :meth:`start` (the thread notices at its next
        wake-up, so parking costs the caller nothing)."""
        self._parked = True

    def start(self) -> None:
        """Start (or unpark) the thread unless it runs (or stopped on an error, kept for
        the loop)."""
        if self._parked:
            with self._park_cond:
                self._parked = False
                self._park_cond.notify_all()
        if self.running or self.error is not None:
            return
        self._stop = False
        if self._wake_r < 0:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # A daemon: a helper must never keep the process alive.
        self._thread = threading.Thread(target=self._run, name="ringtrain-loader-helper",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (call without holding the lock)."""
        thread = self._thread
        self._stop = True
        with self._park_cond:
            self._park_cond.notify_all()
        if thread is threading.current_thread():
            # The loader was collected on the helper thread itself (a garbage-collection
            # pass can run on any thread): it cannot join itself; it exits on its own.
            return
        if thread is not None:
            self._wake()
            thread.join(10.0)
            if thread.is_alive():  # work() blocked: never hang the caller
                log.warning("the loader's helper thread did not stop within 10 s")
                return  # it may still poll the wake-up pipe: leave that open
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self.error = None

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def _run(self) -> None:
        wake = self._wake_r
        while not self._stop:
            if self._parked:
                with self._park_cond:
                    while self._parked and not self._stop:
                        self._park_cond.wait()
                continue
            # Readiness only: the answers are read under the lock, by work().
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            for fd in self._fds():
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll(1000)
            except OSError:  # a descriptor closed under us: the feed is shutting down
                return
            if self._stop:
                return
            if any(fd == wake for fd, _ in events):
                try:
                    while os.read(wake, 64):
                        pass
                except OSError:  # drained
                    pass
            if not events:
                continue
            with self._lock:
                if self._stop:
                    return
                try:
                    self._work()
                except BaseException as exc:  # noqa: BLE001 - the loop re-raises it
                    self.error = exc
                    return
