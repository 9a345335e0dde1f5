"""``num_workers="auto"``: how many loader workers to start, and adaptation.

The start is the CPU budget this process really has (:func:`ringtrain.cpus.cpu_budget`:
affinity and cgroup quota, divided among the training processes that share the host),
less one CPU for the training process itself from 3 CPUs on.

While running, :class:`Autotuner` watches the fraction of time the training loop
waits for batches and adds a worker when it is high; a change that does not cut the
wait is reverted and not retried for a while (exponential back-off), so an I/O-bound
dataset can use more workers than cores and a CPU-bound one does not oversubscribe.
"""

from __future__ import annotations

from ringtrain.cpus import CpuBudget

__all__ = ["initial_workers", "Autotuner"]


def initial_workers(budget: CpuBudget) -> int:
    """Workers to start with: every CPU on a small budget (the training process mostly
    waits on the GPU), one CPU left to the training process from 3 CPUs on."""
    cpus = budget.whole
    return cpus if cpus <= 2 else cpus - 1


class Autotuner:
    """Hill-climbs the worker count on the measured data wait (pure logic, no clocks).

    Call :meth:`observe` once per batch with the time the loop waited for it and the
    time it spent between batches (its step); it returns a new worker count when it
    decides to change, else ``None``.
    """

    def __init__(self, start: int, low: int = 1, high: int = 8, window_batches: int = 32,
                 window_s: float = 1.0, wait_high: float = 0.05, gain: float = 0.8) -> None:
        self.n = start
        self.low, self.high = low, max(low, high)
        self.window_batches, self.window_s = window_batches, window_s
        self.wait_high, self.gain = wait_high, gain
        self._wait = self._busy = 0.0
        self._count = 0
        self._trial: tuple[int, float] | None = None  # (previous n, its wait fraction)
        self._cooldown = 0
        self._backoff = 1
        self.last_fraction = 0.0
        self.reason = ""

    def observe(self, wait_s: float, busy_s: float) -> int | None:
        self._wait += wait_s
        self._busy += busy_s
        self._count += 1
        if self._count < self.window_batches or self._wait + self._busy < self.window_s:
            return None
        frac = self._wait / max(self._wait + self._busy, 1e-12)
        self._wait = self._busy = 0.0
        self._count = 0
        self.last_fraction = frac
        return self._decide(frac)

    def _decide(self, frac: float) -> int | None:
        if self._trial is not None:
            before_n, before = self._trial
            self._trial = None
            if frac <= before * self.gain:
                self._backoff = 1
                self.reason = f"the wait fell from {before:.0%} to {frac:.0%} of the time"
                return None  # keep the new count; the next window may grow again
            self._cooldown = self._backoff
            self._backoff = min(self._backoff * 2, 64)
            self.n = before_n
            self.reason = f"{before_n + 1} workers did not cut the wait ({before:.0%} -> {frac:.0%})"
            return self.n
        if self._cooldown > 0:
            self._cooldown -= 1
            return None
        if frac > self.wait_high and self.n < self.high:
            self._trial = (self.n, frac)
            self.n += 1
            self.reason = f"the training loop waited {frac:.0%} of the time for data"
            return self.n
        return None
