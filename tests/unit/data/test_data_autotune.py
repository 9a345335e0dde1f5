"""CPU budget from affinity + cgroup quota, and the worker-count hill climber."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain.data.autotune import Autotuner, CpuBudget, cgroup_cpu_quota, cpu_budget, initial_workers


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


@pytest.mark.parametrize("cpus,expected", [(0.5, 1), (1, 1), (2, 2), (3, 2), (8, 7)])
def test_initial_workers(cpus: float, expected: int) -> None:
    assert initial_workers(CpuBudget(affinity=64, quota=cpus)) == expected


def _feed(t: Autotuner, wait: float, busy: float, batches: int) -> list[int]:
    changes = []
    for _ in range(batches):
        n = t.observe(wait, busy)
        if n is not None:
            changes.append(n)
    return changes


def test_autotuner_grows_while_more_workers_cut_the_wait() -> None:
    t = Autotuner(2, high=4, window_batches=10, window_s=0.0)
    assert _feed(t, wait=0.5, busy=0.5, batches=10) == [3]  # 50% waiting: try one more
    assert _feed(t, wait=0.2, busy=0.8, batches=10) == []  # it helped: keep 3
    assert _feed(t, wait=0.2, busy=0.8, batches=10) == [4]  # still waiting: try 4
    assert t.n == 4


def test_autotuner_reverts_a_useless_worker_and_backs_off() -> None:
    t = Autotuner(2, high=8, window_batches=10, window_s=0.0)
    assert _feed(t, 0.5, 0.5, 10) == [3]
    assert _feed(t, 0.5, 0.5, 10) == [2]  # no better: revert
    assert "did not cut" in t.reason
    assert _feed(t, 0.5, 0.5, 10) == []  # cooling down
    assert _feed(t, 0.5, 0.5, 10) == [3]  # try again later
    assert _feed(t, 0.5, 0.5, 10) == [2]
    assert _feed(t, 0.5, 0.5, 20) == []  # back-off doubled


def test_autotuner_leaves_a_fed_loop_alone() -> None:
    t = Autotuner(2, high=8, window_batches=10, window_s=0.0)
    assert _feed(t, 0.001, 1.0, 100) == []
    assert t.n == 2
