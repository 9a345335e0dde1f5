"""How many CPUs this process may use: the one answer for ringrun's slots, the workers'
``OMP_NUM_THREADS``, the host agent's report, the loader's ``num_workers="auto"``, the
doctor's facts and the planner's calibration.

``os.cpu_count()`` reports the host's CPUs; a container limited by a cgroup CPU quota
(``docker --cpus 2``, Kubernetes ``limits.cpu``) or a job pinned by ``taskset`` /
Slurm has far fewer, and starting a rank, a thread or a loader worker per host CPU there
makes them fight over the few it has. The count is therefore the minimum of

* the CPU affinity mask (``os.sched_getaffinity``),
* the cgroup quota: v2 ``cpu.max`` ("quota period"), v1 ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us``, taking the tightest along the cgroup's ancestors,

divided among the processes that share it (``share``: the training processes of a host).
Standard library only: the host agent runs without torch and imports this file.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CGROUP_ROOT", "CpuBudget", "affinity_cpus", "cgroup_cpu_quota", "cpu_budget", "cpu_count"]

#: Where ``/proc`` and ``/sys`` are read from (tests point it at a fake tree).
CGROUP_ROOT = "/"


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use, and where the limit came from."""

    affinity: int
    quota: float | None  # CPUs allowed by the cgroup, None when unlimited
    share: int = 1  # processes on this host splitting the budget

    @property
    def cpus(self) -> float:
        limit = float(self.affinity) if self.quota is None else min(self.affinity, self.quota)
        return max(limit / max(1, self.share), 0.0)

    @property
    def whole(self) -> int:
        """Whole CPUs, at least one (a quota of 2.5 CPUs is 2 slots or threads)."""
        return max(1, math.floor(self.cpus + 1e-9))

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        return (f"CPU budget {self.cpus:g}: affinity {self.affinity} CPUs, cgroup quota {quota}, "
                f"{self.share} training process(es) on this host")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    """``quota / period`` in CPUs; None for no limit (``max``, ``-1``) or an unreadable value."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _v2_quota(directory: Path, stop: Path) -> float | None:
    best: float | None = None
    d = directory
    while True:
        text = _read(d / "cpu.max")
        parts = text.split() if text else []
        q = _ratio(parts[0], parts[1]) if len(parts) == 2 else None
        if q is not None:
            best = q if best is None else min(best, q)
        if d == stop or d.parent == d:
            return best
        d = d.parent


def _v1_quota(directory: Path, stop: Path) -> float | None:
    best: float | None = None
    d = directory
    while True:
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        q = _ratio(quota, period) if quota and period else None
        if q is not None:
            best = q if best is None else min(best, q)
        if d == stop or d.parent == d:
            return best
        d = d.parent


def cgroup_cpu_quota(root: str | os.PathLike[str] | None = None) -> float | None:
    """The CPU quota of this process's cgroup in CPUs, or None when there is none.

    ``root`` (default :data:`CGROUP_ROOT`) lets tests point at a fake ``/proc`` and
    ``/sys`` tree.
    """
    base = Path(CGROUP_ROOT if root is None else root)
    text = _read(base / "proc/self/cgroup") or ""
    fs = base / "sys/fs/cgroup"
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


def affinity_cpus() -> int:
    """The CPUs in this process's affinity mask (the host's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cpu_budget(share: int = 1, root: str | os.PathLike[str] | None = None) -> CpuBudget:
    """The CPUs available to this process (see the module docstring)."""
    return CpuBudget(affinity=affinity_cpus(), quota=cgroup_cpu_quota(root), share=max(1, share))


def cpu_count(share: int = 1, root: str | os.PathLike[str] | None = None) -> int:
    """Whole CPUs for each of ``share`` processes, at least one (see :class:`CpuBudget`)."""
    return cpu_budget(share, root).whole
