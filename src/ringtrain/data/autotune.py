"""``num_workers="auto"``: the CPU budget this process really has, and adaptation.

``os.cpu_count()`` reports the host's CPUs; a container limited by a cgroup CPU quota
(``docker --cpus 2``, Kubernetes ``limits.cpu``) or a job pinned by ``taskset`` /
Slurm has far fewer, and starting a worker per host CPU there makes workers fight
over the few it has. The budget is therefore the minimum of

* the CPU affinity mask (``os.sched_getaffinity``),
* the cgroup quota: v2 ``cpu.max`` ("quota period"), v1 ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us``, taking the tightest along the cgroup's ancestors,

divided among the training processes that share the host (``local_size``).

While running, :class:`Autotuner` watches the fraction of time the training loop
waits for batches and adds a worker when it is high; a change that does not cut the
wait is reverted and not retried for a while (exponential back-off), so an I/O-bound
dataset can use more workers than cores and a CPU-bound one does not oversubscribe.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBudget", "cpu_budget", "cgroup_cpu_quota", "initial_workers", "Autotuner"]


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use, and where the limit came from."""

    affinity: int
    quota: float | None  # CPUs allowed by the cgroup, None when unlimited
    share: int = 1  # training processes on this host splitting the budget

    @property
    def cpus(self) -> float:
        limit = float(self.affinity) if self.quota is None else min(self.affinity, self.quota)
        return max(limit / max(1, self.share), 0.0)

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        return (f"CPU budget {self.cpus:g}: affinity {self.affinity} CPUs, cgroup quota {quota}, "
                f"{self.share} training process(es) on this host")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _v2_quota(directory: Path, stop: Path) -> float | None:
    best: float | None = None
    d = directory
    while True:
        text = _read(d / "cpu.max")
        if text:
            parts = text.split()
            if len(parts) == 2 and parts[0] != "max":
                q = int(parts[0]) / int(parts[1])
                best = q if best is None else min(best, q)
        if d == stop or d.parent == d:
            return best
        d = d.parent


def _v1_quota(directory: Path, stop: Path) -> float | None:
    best: float | None = None
    d = directory
    while True:
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0 and int(period) > 0:
            q = int(quota) / int(period)
            best = q if best is None else min(best, q)
        if d == stop or d.parent == d:
            return best
        d = d.parent


def cgroup_cpu_quota(root: str | os.PathLike[str] = "/") -> float | None:
    """The CPU quota of this process's cgroup in CPUs, or None when there is none.

    ``root`` lets tests point at a fake ``/proc`` and ``/sys`` tree.
    """
    root = Path(root)
    text = _read(root / "proc/self/cgroup") or ""
    fs = root / "sys/fs/cgroup"
    best: float | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # cgroup v2 (unified)
            candidates = [(fs / rel, fs), (fs, fs)]  # in a container the path may be the host's
            found = [_v2_quota(d, stop) for d, stop in candidates if d.is_dir()]
        elif "cpu" in controllers.split(","):
            found = []
            for mount in (fs / controllers, fs / "cpu", fs / "cpu,cpuacct"):
                if mount.is_dir():
                    found += [_v1_quota(d, mount) for d in (mount / rel, mount) if d.is_dir()]
                    break
        else:
            continue
        for q in found:
            if q is not None:
                best = q if best is None else min(best, q)
    return best


def cpu_budget(share: int = 1, root: str | os.PathLike[str] = "/") -> CpuBudget:
    """The CPUs available to this process (see the module docstring)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    return CpuBudget(affinity=affinity, quota=cgroup_cpu_quota(root), share=max(1, share))


def initial_workers(budget: CpuBudget) -> int:
    """Workers to start with: every CPU on a small budget (the training process mostly
    waits on the GPU), one CPU left to the training process from 3 CPUs on."""
    cpus = max(1, math.floor(budget.cpus + 1e-9))
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
