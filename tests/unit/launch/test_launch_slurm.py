"""ringrun inside a Slurm allocation: nodes, slots, -np and the srun transport (pure)."""

from __future__ import annotations

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch.cli import build_config
from ringtrain.launch.hosts import Host
from ringtrain.launch.slurm import allocation, expand_counts, srun_argv

BATCH = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-02],cpu7", "SLURM_TASKS_PER_NODE": "2(x2),1",
         "SLURM_JOB_CPUS_PER_NODE": "8(x2),4", "SLURM_NTASKS": "5"}


@pytest.mark.parametrize("text,want", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,1", [1, 1])])
def test_per_node_counts(text: str, want: list[int]) -> None:
    assert expand_counts(text) == want


def test_per_node_counts_reject_garbage() -> None:
    with pytest.raises(ConfigError, match="per-node count"):
        expand_counts("2(y3)")


def test_allocation_from_a_batch_script() -> None:
    alloc = allocation(BATCH)
    assert alloc is not None
    assert alloc.hosts == (Host("gpu01", 2), Host("gpu02", 2), Host("cpu7", 1))
    assert alloc.ntasks == 5 and alloc.cpus == {"gpu01": 8, "gpu02": 8, "cpu7": 4}


def test_no_allocation_outside_slurm() -> None:
    assert allocation({}) is None
    assert allocation({"SLURM_JOB_ID": "1"}) is None


def test_ringrun_as_one_of_many_tasks_is_refused() -> None:
    with pytest.raises(ConfigError, match="one of 4 tasks"):
        allocation({**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"})


def test_an_interactive_one_task_step_is_fine() -> None:
    assert allocation({**BATCH, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is not None


def test_counts_that_do_not_match_the_nodes_are_refused() -> None:
    with pytest.raises(ConfigError, match="3 node"):
        allocation({**BATCH, "SLURM_TASKS_PER_NODE": "2"})


def test_srun_runs_one_agent_task_on_the_node() -> None:
    argv = srun_argv("gpu01", "/venv/bin/python", "/x/agent.py", cpus=8)
    assert argv[0] == "srun" and argv[-2:] == ["/venv/bin/python", "/x/agent.py"]
    for opt in ("--nodes=1", "--ntasks=1", "--nodelist=gpu01", "--overlap", "--cpus-per-task=8"):
        assert opt in argv


@pytest.fixture
def in_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in BATCH.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)


@pytest.mark.usefixtures("in_batch")
def test_ringrun_in_a_batch_script_takes_nodes_and_np_from_slurm() -> None:
    cfg = build_config(["python", "-c", "pass"])
    assert cfg.transport == "srun" and cfg.slurm_cpus["gpu01"] == 8
    assert [p.host for p in cfg.placements] == ["gpu01", "gpu01", "gpu02", "gpu02", "cpu7"]
    assert cfg.multi_host and not any(cfg.is_local(h) for h in cfg.hosts)


@pytest.mark.usefixtures("in_batch")
def test_more_ranks_than_the_allocations_tasks_needs_oversubscribe() -> None:
    with pytest.raises(ConfigError, match=r"slots of Slurm job 42 .*--ntasks-per-node"):
        build_config(["-np", "6", "true"])
    assert len(build_config(["-np", "6", "--oversubscribe", "true"]).placements) == 6


@pytest.mark.usefixtures("in_batch")
def test_explicit_hosts_win_over_the_allocation() -> None:
    cfg = build_config(["-np", "2", "-H", "localhost:2", "true"])
    assert cfg.transport == "ssh" and cfg.is_local("localhost")


def test_np_is_required_outside_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match="-np N is required"):
        build_config(["true"])


class _Refusing:
    """A host agent whose start is refused ``refusals`` times, then comes up."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.connects = refusals, 0

    def wait_ready(self, deadline: float) -> bool:
        return self.connects >= self.refusals

    def ssh_done(self) -> bool:
        return self.connects < self.refusals

    def problem(self) -> str:
        return "srun: error: Unable to create step: Requested node configuration is not available"

    def connect(self) -> None:
        self.connects += 1


def _cfg(transport: str) -> object:
    import types

    return types.SimpleNamespace(start_timeout=10.0, transport=transport,
                                 ssh=types.SimpleNamespace(port=None))


def test_under_srun_a_first_refused_step_is_retried_until_the_node_takes_it() -> None:
    """A requeued job can start while a node back from a failure still refuses steps:
    under srun that is Slurm not ready yet, not a wrong host name."""
    from ringtrain.launch.job import await_agents

    host = _Refusing(refusals=2)
    await_agents(_cfg("srun"), {"n2": host}, 0, [])  # type: ignore[arg-type, dict-item]
    assert host.connects == 2


def test_over_ssh_a_first_refused_host_is_an_error_at_once() -> None:
    from ringtrain.launch.job import HostsDown, await_agents

    host = _Refusing(refusals=2)
    with pytest.raises(HostsDown, match="could not start the host agent on n2"):
        await_agents(_cfg("ssh"), {"n2": host}, 0, [])  # type: ignore[arg-type, dict-item]
    assert host.connects == 0
