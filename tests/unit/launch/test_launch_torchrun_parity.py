"""The variables ringrun's ranks get, against what torchrun gives its workers
(torch/distributed/elastic/agent/server/local_elastic_agent.py, ``_start_workers``)."""

from __future__ import annotations

import os

import pytest

from ringtrain.launch.agent import worker_extras
from ringtrain.launch.hosts import Placement
from ringtrain.launch.job import worker_env

LOCAL = Placement(0, "localhost", 0, 2, 0, 1)


def _local_rank_env() -> dict[str, str]:
    # As job.py builds a local rank's environment: ringrun's own, the contract over it.
    full = dict(os.environ)
    full.update(worker_env(LOCAL, 2, "127.0.0.1", 29500, 0, "run", {}))
    full.update(worker_extras(full, LOCAL.local_size, 1))
    return full


def test_omp_num_threads_in_ringruns_environment_reaches_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun keeps a value the user set and fills in 1 only when it is unset; ringrun
    # replaced OMP_NUM_THREADS=7 by its own share of the cores.
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert _local_rank_env()["OMP_NUM_THREADS"] == "7"


def test_omp_num_threads_is_filled_in_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert int(_local_rank_env()["OMP_NUM_THREADS"]) >= 1


@pytest.mark.parametrize("given,want", [(None, "1"), ("3", "3")])
def test_nccl_async_error_handling_as_torchrun_sets_it(
        monkeypatch: pytest.MonkeyPatch, given: str | None, want: str) -> None:
    # torchrun: os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"); torch's own default is 3.
    if given is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", given)
    assert _local_rank_env()["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == want
    # a remote rank: the agent fills it in on its host
    assert worker_extras({}, 1, 1)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
