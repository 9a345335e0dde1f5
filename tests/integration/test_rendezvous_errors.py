"""A rank that never joins, or a rank that cannot reach rank 0, is a one-line error
naming the ranks or the address, after the init timeout (issue: rank 0 waited, then
failed with a raw DistStoreError that named no rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
from ringtest import free_port

CODE = "import ringtrain as rt; rt.init(); print('joined')"


def _rank(rank: int, size: int, port: int, timeout: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "RANK", "WORLD_SIZE"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size), RINGTRAIN_INIT_TIMEOUT=timeout)
    return subprocess.Popen([sys.executable, "-c", CODE], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Any]:
    """Both cases at once: each waits out an init timeout, so they overlap their waits."""
    never_came = free_port()
    unreachable = free_port()  # nobody listens there
    while unreachable == never_came:
        unreachable = free_port()
    t0 = time.monotonic()
    procs = {"rank 0": _rank(0, 3, never_came, "6"), "rank 1": _rank(1, 3, never_came, "6"),  # rank 2 never starts
             "alone": _rank(1, 2, unreachable, "5")}
    done = {name: (p.returncode, err) for name, p in procs.items()
            for _, err in [p.communicate(timeout=80)]}
    return {"results": done, "seconds": time.monotonic() - t0, "unreachable": unreachable}


@pytest.mark.timeout(90)
def test_rank_0_names_the_ranks_that_never_came(outcomes: dict[str, Any]) -> None:
    for name in ("rank 0", "rank 1"):
        code, err = outcomes["results"][name]
        assert code != 0
        assert "rank(s) 2 of 3 did not join the job" in err, err[-1500:]


@pytest.mark.timeout(90)
def test_a_rank_that_cannot_reach_rank_0_names_the_address(outcomes: dict[str, Any]) -> None:
    code, err = outcomes["results"]["alone"]
    assert code != 0 and outcomes["seconds"] < 60
    port = outcomes["unreachable"]
    assert f"cannot reach rank 0's rendezvous at 127.0.0.1:{port} within 5 s" in err, err[-1500:]
