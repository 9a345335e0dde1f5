"""The one CPU count (ringtrain.cpus): affinity and cgroup v1 / v2 quotas, read from a
fake /proc and /sys tree, and every part that counts CPUs getting the same answer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ringtrain import cpus
from ringtrain.cpus import CpuBudget, cgroup_cpu_quota, cpu_budget, cpu_count


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_cgroup_v2_quota_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "0::/job/step\n")
    _write(tmp_path, "sys/fs/cgroup/job/cpu.max", "150000 100000\n")
    _write(tmp_path, "sys/fs/cgroup/job/step/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path) == pytest.approx(1.5)


def test_cgroup_v2_container_view(tmp_path: Path) -> None:
    # Inside a container the listed path is the host's; the quota sits at the mount root.
    _write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/abc\n")
    _write(tmp_path, "sys/fs/cgroup/cpu.max", "200000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == pytest.approx(2.0)


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path) == pytest.approx(0.5)


@pytest.mark.parametrize("files", [{}, {"proc/self/cgroup": "0::/\n",
                                        "sys/fs/cgroup/cpu.max": "max 100000\n"},
                                   {"proc/self/cgroup": "3:cpu:/\n",
                                    "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
                                    "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}])
def test_no_quota(tmp_path: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        _write(tmp_path, rel, text)
    assert cgroup_cpu_quota(tmp_path) is None


def test_budget_is_min_of_affinity_and_quota_split_by_local_processes() -> None:
    assert CpuBudget(affinity=8, quota=None).cpus == 8
    assert CpuBudget(affinity=8, quota=2.5).cpus == 2.5
    assert CpuBudget(affinity=8, quota=None, share=4).cpus == 2
    assert "affinity 8" in CpuBudget(affinity=8, quota=2.5).describe()
    real = cpu_budget()
    assert 0 < real.cpus <= real.affinity


@pytest.mark.parametrize("quota,share,whole", [(None, 1, 8), (2.5, 1, 2), (0.5, 1, 1), (None, 3, 2),
                                               (4.0, 8, 1)])
def test_whole_cpus_round_down_and_never_reach_zero(quota: float | None, share: int, whole: int) -> None:
    assert CpuBudget(affinity=8, quota=quota, share=share).whole == whole


def test_an_unreadable_quota_is_no_quota(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "0::/\n")
    _write(tmp_path, "sys/fs/cgroup/cpu.max", "garbage here\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_the_count_honours_the_quota(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "0::/job\n")
    _write(tmp_path, "sys/fs/cgroup/job/cpu.max", "100000 100000\n")
    assert cpu_count(root=tmp_path) == 1
    assert cpu_count(share=4, root=tmp_path) == 1


def test_every_part_that_counts_cpus_asks_the_same_function(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A container limited to one CPU: ringrun's slots, the workers' OMP_NUM_THREADS, the
    host agent's report, the loader's budget, the doctor's facts and the calibration all
    say one CPU, whatever the affinity mask holds."""
    from ringtrain.data.autotune import initial_workers
    from ringtrain.launch import agent, job, slots
    from ringtrain.launch.hosts import Placement
    from ringtrain.observe import session
    from ringtrain.plan import calibrate

    _write(tmp_path, "proc/self/cgroup", "0::/job\n")
    _write(tmp_path, "sys/fs/cgroup/job/cpu.max", "100000 100000\n")
    monkeypatch.setattr(cpus, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(slots, "_gpus", lambda: 0)
    assert slots.local_slots({}).count == 1
    env = job.worker_env(Placement(0, "localhost", 0, 1, 0, 1), 1, "127.0.0.1", 1, 0, "r", {})
    assert env["OMP_NUM_THREADS"] == "1"
    assert agent.info()["cpus"] == 1
    assert initial_workers(cpu_budget()) == 1
    assert session._cpu_facts(1)["per_rank"] == 1.0
    assert calibrate.cpu_count() == 1
    assert math.isclose(cpu_budget().cpus, 1.0)
