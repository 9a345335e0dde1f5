"""ringrun's ranks join although ringrun's own environment has torchrun's
TORCHELASTIC_USE_AGENT_STORE=True (ringrun started from a torchrun worker): before, rank
0 took itself for a client of torchrun's agent store, and every rank waited out the
rendezvous timeout (300 s by default) before failing."""

from __future__ import annotations

from typing import Any

import pytest
from ringtest import run_world


def _join_as_ringruns_rank() -> dict[str, Any]:
    import os

    import torch

    import ringtrain as rt

    # What ringrun gives its ranks (launch/job.py worker_env) over an environment that
    # still has the torchrun worker's agent-store flag. No RINGTRAIN_STORE_FD: rank 0
    # binds MASTER_PORT itself.
    rank, size = os.environ["RANK"], os.environ["WORLD_SIZE"]
    os.environ.update(RINGTRAIN_RANK=rank, RINGTRAIN_SIZE=size, RINGTRAIN_LOCAL_RANK=rank,
                      RINGTRAIN_LOCAL_SIZE=size, RINGTRAIN_RUN_ID="stale", TORCHELASTIC_RUN_ID="stale",
                      TORCHELASTIC_USE_AGENT_STORE="True", RINGTRAIN_INIT_TIMEOUT="4")
    world = rt.init()
    total = rt.allreduce(torch.tensor([float(rt.rank() + 1)]), op=rt.Sum)
    out = {"launcher": world.env.launcher, "agent_store": world.env.agent_store, "sum": total.item()}
    rt.shutdown()
    return out


@pytest.mark.timeout(60)
def test_ringruns_ranks_join_despite_an_inherited_agent_store_flag() -> None:
    got = run_world(_join_as_ringruns_rank, 2, init=False, timeout=40)
    assert got == [{"launcher": "ringrun", "agent_store": False, "sum": 3.0}] * 2
