"""A script's own ``init_process_group()`` (env://, on the launcher's MASTER_PORT) next to
ringtrain's world in one process, rank 0 hosting both stores, as under torchrun (where
every rank is a client of the agent's store, so each of these works):

- ``rt.init() -> rt.shutdown() -> init_process_group()``: rank 0's ringtrain store server
  kept MASTER_PORT, and the script's store failed to bind it (EADDRINUSE; under ringrun
  the same, on the socket ringrun hands rank 0);
- ``init_process_group()``, a DDP module kept, ``destroy_process_group()``, then
  ``rt.init()``: the module holds the destroyed group and its store, so the script's
  server still listens on MASTER_PORT, and rank 0's ``rt.init()`` could not listen there
  (LaunchEnvError "Address already in use");
- ``rt.init()``, the script's ``destroy_process_group()`` (the DDP tutorials' cleanup()),
  ``rt.init()``: the second returned the destroyed world, and the next collective failed
  ("Default process group has not been initialized");
- ... ``destroy_process_group()``, ``init_process_group()``, ``rt.shutdown()``: ringtrain
  destroyed the group the script had just made.

(A second group of the script's on the same server would meet the first one's keys, as
under torchrun: not a sequence to test.)
"""

from __future__ import annotations

from typing import Any

import pytest
from ringtest import World, start_world


def _sum(rank: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


def _rt_then_own() -> list[float]:
    import torch.distributed as dist

    import ringtrain as rt

    got = []
    rt.init()
    got.append(_sum(rt.rank()))
    rt.shutdown()
    dist.init_process_group("gloo")  # env://: MASTER_ADDR/MASTER_PORT, as the launcher set them
    got.append(_sum(dist.get_rank()))
    dist.destroy_process_group()
    rt.init()
    got.append(_sum(rt.rank()))
    rt.shutdown()
    return got


def _own_kept_then_rt() -> list[float]:
    import torch
    import torch.distributed as dist

    import ringtrain as rt

    got = []
    dist.init_process_group("gloo")
    got.append(_sum(dist.get_rank()))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    dist.destroy_process_group()  # the module still holds the group, and its store server
    rt.init()
    got.append(_sum(rt.rank()))
    rt.shutdown()
    rt.init()
    got.append(_sum(rt.rank()))
    rt.shutdown()
    del model
    return got


def _rt_group_ended_by_script() -> list[float]:
    import torch.distributed as dist

    import ringtrain as rt

    got = []
    rt.init()
    got.append(_sum(rt.rank()))
    dist.destroy_process_group()  # ringtrain's group, ended by the script
    rt.init()
    got.append(_sum(rt.rank()))
    dist.destroy_process_group()
    dist.init_process_group("gloo")
    rt.shutdown()  # ringtrain's world is over; the script's group is the script's
    got.append(_sum(dist.get_rank()))
    dist.destroy_process_group()
    return got


@pytest.fixture(scope="module")
def worlds() -> dict[str, World]:
    return {"rt_then_own": start_world(_rt_then_own, 2, init=False, timeout=60),
            "own_kept_then_rt": start_world(_own_kept_then_rt, 2, init=False, timeout=90),
            "ended_by_script": start_world(_rt_group_ended_by_script, 2, init=False, timeout=120)}


def test_own_init_process_group_after_rt_shutdown(worlds: dict[str, Any]) -> None:
    assert worlds["rt_then_own"].results() == [[3.0, 3.0, 3.0]] * 2


def test_rt_init_while_a_destroyed_groups_store_still_serves(worlds: dict[str, Any]) -> None:
    assert worlds["own_kept_then_rt"].results() == [[3.0, 3.0, 3.0]] * 2


def test_rt_init_and_shutdown_after_the_script_ended_ringtrains_group(worlds: dict[str, Any]) -> None:
    assert worlds["ended_by_script"].results() == [[3.0, 3.0, 3.0]] * 2
