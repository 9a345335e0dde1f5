"""A script that starts ``torch.distributed`` itself and uses ringtrain on that group, the
way the DDP tutorials are written: ``mp.spawn`` with ``init_process_group(rank=rank,
world_size=world_size)`` and no launcher variables, ``rt.init() -> rt.shutdown() ->
rt.init()`` on the script's group, and a second job phase (``destroy_process_group()``,
``init_process_group()``, ``rt.init()``). Plain torch runs each of them; ringtrain must
follow (issues: the first was a LaunchEnvError "the launcher says rank 0 of 1"; the
second reused the first world's store keys, so the exchange group's Gloo connected to
old addresses, "Connection refused"; in the third ``rt.init()`` returned the destroyed
world, and ringtrain's hold on the script's store kept rank 0's server listening on
MASTER_PORT after ``destroy_process_group()``)."""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

import pytest
from ringtest import free_port, run_world

from ringtrain.env import LaunchEnv, from_group, rendezvous_without_rank

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


def _ring_sum(rt: Any, rank: int, name: str) -> float:
    import torch

    return float(rt.allreduce(torch.tensor([float(rank + 1)]), op=rt.Sum, name=name, algorithm="ring").item())


def _phases(second_port: int) -> dict[str, Any]:
    import torch.distributed as dist

    import ringtrain as rt
    from ringtrain.runtime.membership import MEMBERSHIP

    # mp.spawn's environment: MASTER_ADDR/MASTER_PORT only, rank and size passed in.
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name in _LAUNCH_VARS:
        del os.environ[name]
    out: dict[str, Any] = {}
    try:
        rt.init()
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        out["alone"] = f"{type(exc).__name__}: {exc}"
    port = int(os.environ["MASTER_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = rt.init(backend="nccl")
    out["warned"] = [str(w.message) for w in caught]
    out["who"] = (rt.rank(), rt.size(), rt.local_rank(), rt.local_size(), rt.cross_rank(), rt.cross_size())
    out["sum1"] = _ring_sum(rt, rank, "a")
    prefix1 = MEMBERSHIP.rendezvous.prefix
    rt.shutdown()
    rt.init()  # the same group of the script's, joined again
    out["prefixes_differ"] = MEMBERSHIP.rendezvous.prefix != prefix1
    out["sum2"] = _ring_sum(rt, rank, "b")
    dist.destroy_process_group()  # the script ends its group without rt.shutdown()
    out["port_freed"] = _port_free(port) if rank == 0 else True
    os.environ["MASTER_PORT"] = str(second_port)  # a second phase on a port of its own
    dist.init_process_group("gloo", rank=rank, world_size=size)
    second = rt.init()
    out["new_world"] = second is not first
    out["sum3"] = _ring_sum(rt, rank, "c")
    rt.shutdown()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def phases() -> list[dict[str, Any]]:
    return run_world(_phases, 2, free_port(), init=False, timeout=60)


def test_rt_init_alone_in_a_spawned_process_is_refused(phases: list[dict[str, Any]]) -> None:
    for out in phases:
        assert out["alone"].startswith("LaunchEnvError: rt.init() in a process started by multiprocessing")
        assert "RANK" in out["alone"]


def test_the_scripts_group_gives_rank_and_size(phases: list[dict[str, Any]]) -> None:
    assert [out["who"] for out in phases] == [(0, 2, 0, 2, 0, 1), (1, 2, 1, 2, 0, 1)]
    assert [out["sum1"] for out in phases] == [3.0, 3.0]


def test_a_backend_argument_without_effect_is_a_warning(phases: list[dict[str, Any]]) -> None:
    for out in phases:
        assert any("rt.init(backend='nccl') has no effect" in w for w in out["warned"]), out["warned"]


def test_joining_the_same_group_again_uses_fresh_keys(phases: list[dict[str, Any]]) -> None:
    for out in phases:
        assert out["prefixes_differ"] and out["sum2"] == 3.0


def test_a_second_phase_joins_the_new_group(phases: list[dict[str, Any]]) -> None:
    for out in phases:
        assert out["port_freed"], "rank 0's store still listens after destroy_process_group()"
        assert out["new_world"] and out["sum3"] == 3.0


def test_place_in_a_group_across_hosts() -> None:
    env = LaunchEnv("none", 0, 1, 0, 1, 0, 1, "127.0.0.1", None)
    got = from_group(env, 2, 4, ["a", "a", "b", "b"], ("a", 29500))
    assert (got.launcher, got.rank, got.size, got.local_rank, got.local_size, got.cross_rank, got.cross_size) == (
        "script", 2, 4, 0, 2, 1, 2)
    assert from_group(env, 1, 2, ["a", "a"], None).master_port is None  # a file:// group: no port


@pytest.mark.parametrize(("environ", "want"), [
    ({"MASTER_ADDR": "localhost", "MASTER_PORT": "12355"}, True),   # the tutorials' setup()
    ({"MASTER_PORT": "12355", "RANK": "0", "WORLD_SIZE": "2"}, False),
    ({}, False),
])
def test_rendezvous_without_rank(environ: dict[str, str], want: bool) -> None:
    assert rendezvous_without_rank(environ) is want
