"""ringtrain.horovod refuses what Horovod refuses, with its exception class: an allgather
or alltoall of a 0-d tensor (Horovod's controller: "tried to ALLGATHER a rank-zero
tensor"), ``op=hvd.Adasum`` on a non-power-of-two number of ranks or on a process set
(horovod/torch/mpi_ops.py: NotImplementedError), ``hvd.mpi_threads_supported()``
without MPI (ValueError), ``hvd.init(comm=)`` with a subset of the ranks; and reads
``HOROVOD_GLOO_IFACE`` (the interface Horovod's Gloo binds) as ``GLOO_SOCKET_IFNAME``.
Each scenario returned a result here before its fix (a scalar gathered as one row, an
Adasum tree over 3 ranks, False, an accepted subset) or ignored the variable. One 3-rank
world runs the scenarios (Adasum needs 3 ranks); each also checks the ranks are still
in step after it."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
from ringtest import error_of, run_scenarios, run_world, scenario_results

from ringtrain.errors import ConfigError
from ringtrain.horovod import basics

_HAS_LO = "lo" in [n for _, n in socket.if_nameindex()]


def _in_step(hvd: Any) -> float:
    return float(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())


def _then(hvd: Any, call: Any) -> dict[str, Any]:
    return {"error": error_of(call), "after": _in_step(hvd)}


def _scenarios(hvd: Any) -> list[tuple[str, Any]]:
    r = hvd.rank()
    ps = hvd.add_process_set([0, 1])
    scalar = torch.tensor(float(r))
    return [
        ("iface", lambda: {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"), "after": _in_step(hvd)}),
        ("mpi_threads", lambda: _then(hvd, hvd.mpi_threads_supported)),
        ("comm_every_rank", lambda: _then(hvd, lambda: hvd.init(comm=[2, 1, 0]))),
        ("allgather_scalar", lambda: _then(hvd, lambda: hvd.allgather(scalar))),
        # one rank's scalar: its own error, a refusal naming it on the others (no stall)
        ("allgather_scalar_one_rank", lambda: _then(hvd, lambda: hvd.allgather(scalar if r == 1 else scalar.reshape(1)))),
        ("grouped_allgather_scalar", lambda: _then(hvd, lambda: hvd.grouped_allgather([torch.ones(2), scalar]))),
        ("alltoall_scalar", lambda: _then(hvd, lambda: hvd.alltoall(scalar, splits=[1, 0, 0]))),
        ("adasum_three_ranks", lambda: _then(hvd, lambda: hvd.allreduce(torch.ones(2) * (r + 1), op=hvd.Adasum))),
        ("grouped_adasum_three_ranks", lambda: _then(hvd, lambda: hvd.grouped_allreduce([torch.ones(2)], op=hvd.Adasum))),
        ("adasum_process_set", lambda: _then(hvd, lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum, process_set=ps)
                                             if r in (0, 1) else None)),
    ]


def _world() -> dict[str, Any]:
    import ringtrain.horovod as hvd

    out = {"mpi_threads_before_init": error_of(hvd.mpi_threads_supported),
           "comm_subset": error_of(lambda: hvd.init(comm=[0, 1]))}
    hvd.shutdown()
    out["comm_empty"] = error_of(lambda: hvd.init(comm=[]))  # Horovod: an empty list is the whole job
    if not hvd.is_initialized():
        hvd.init()
    out.update(run_scenarios(_scenarios(hvd)))
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    env = {"RINGTRAIN_STALL_TIMEOUT": "4"}
    if _HAS_LO:
        env["HOROVOD_GLOO_IFACE"] = "lo"
    return run_world(_world, 3, init=False, env=env, timeout=90)


def _error(out: dict[str, Any]) -> tuple[str, str]:
    assert out["error"] is not None, out
    return out["error"]  # type: ignore[no-any-return]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label", ["allgather_scalar", "grouped_allgather_scalar", "alltoall_scalar"])
def test_a_scalar_allgather_or_alltoall_is_refused(world: list[dict[str, Any]], label: str) -> None:
    for out in scenario_results(world, label, after=3.0):
        kind, text = _error(out)
        assert kind == "HorovodUsageError" and "rank-zero" in text, (kind, text)


@pytest.mark.timeout(120)
def test_a_scalar_on_one_rank_is_an_error_on_every_rank(world: list[dict[str, Any]]) -> None:
    outs = scenario_results(world, "allgather_scalar_one_rank", after=3.0)
    assert _error(outs[1])[0] == "HorovodUsageError", outs[1]
    for rank in (0, 2):
        kind, text = _error(outs[rank])
        assert "rank 1" in text and "rank-zero" in text, (kind, text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label", ["adasum_three_ranks", "grouped_adasum_three_ranks"])
def test_adasum_on_three_ranks_is_not_implemented(world: list[dict[str, Any]], label: str) -> None:
    for out in scenario_results(world, label, after=3.0):
        kind, text = _error(out)
        assert kind == "NotImplementedError" and "power of 2" in text, (kind, text)


@pytest.mark.timeout(120)
def test_adasum_on_a_process_set_is_not_implemented(world: list[dict[str, Any]]) -> None:
    outs = scenario_results(world, "adasum_process_set", after=3.0)
    for out in outs[:2]:
        kind, text = _error(out)
        assert kind == "NotImplementedError" and "process sets" in text, (kind, text)


@pytest.mark.timeout(120)
def test_mpi_threads_supported_is_a_value_error(world: list[dict[str, Any]]) -> None:
    for rank_out, out in zip(world, scenario_results(world, "mpi_threads", after=3.0), strict=True):
        for error in (rank_out["mpi_threads_before_init"], _error(out)):
            assert error is not None and error[0] == "ValueError" and "MPI is not enabled" in error[1], error


@pytest.mark.timeout(120)
def test_init_comm_takes_every_rank_and_refuses_a_subset(world: list[dict[str, Any]]) -> None:
    for rank_out in world:
        kind, text = rank_out["comm_subset"]
        assert kind == "ConfigError" and "subset" in text, (kind, text)
    for out in scenario_results(world, "comm_every_rank", after=3.0):
        assert out["error"] is None, out
    assert [rank_out["comm_empty"] for rank_out in world] == [None] * 3


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _HAS_LO, reason="no loopback interface named lo")
def test_horovod_gloo_iface_is_the_interface_gloo_binds(world: list[dict[str, Any]]) -> None:
    for out in scenario_results(world, "iface", after=3.0):
        assert out["GLOO_SOCKET_IFNAME"] == "lo", out


def test_horovod_gloo_iface_wins_over_gloo_socket_ifname() -> None:
    # Horovod's Gloo reads HOROVOD_GLOO_IFACE only; torch's Gloo reads GLOO_SOCKET_IFNAME.
    name = socket.if_nameindex()[0][1]
    environ = {"HOROVOD_GLOO_IFACE": name, "GLOO_SOCKET_IFNAME": "elsewhere0"}
    basics._gloo_iface(environ)
    assert environ["GLOO_SOCKET_IFNAME"] == name
    untouched = {"GLOO_SOCKET_IFNAME": "eth9"}
    basics._gloo_iface(untouched)
    assert untouched == {"GLOO_SOCKET_IFNAME": "eth9"}


def test_a_bad_horovod_gloo_iface_names_the_variable_and_the_interfaces() -> None:
    environ = {"HOROVOD_GLOO_IFACE": "nosuch0"}
    with pytest.raises(ConfigError, match="HOROVOD_GLOO_IFACE='nosuch0'") as info:
        basics._gloo_iface(environ)
    assert socket.if_nameindex()[0][1] in str(info.value)
    assert "GLOO_SOCKET_IFNAME" not in environ


def _bad_iface() -> Any:
    import ringtrain.horovod as hvd

    hvd.init()


@pytest.mark.timeout(60)
def test_hvd_init_with_a_bad_horovod_gloo_iface_fails_on_every_rank() -> None:
    errors = run_world(_bad_iface, 2, init=False, env={"HOROVOD_GLOO_IFACE": "nosuch0"}, timeout=30,
                       expect_failure=True)
    for text in errors:
        assert "ConfigError" in text and "HOROVOD_GLOO_IFACE='nosuch0'" in text, text
