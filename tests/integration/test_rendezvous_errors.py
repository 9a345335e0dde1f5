"""A rank that never joins, or a rank that cannot reach rank 0, is a one-line error
naming the ranks or the address, after the init timeout (issue: rank 0 waited, then
failed with a raw DistStoreError that named no rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from ringtest import free_port

CODE = "import ringtrain as rt; rt.init(); print('joined')"


def _rank(rank: int, size: int, port: int, timeout: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "RANK", "WORLD_SIZE"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size), RINGTRAIN_INIT_TIMEOUT=timeout)
    return subprocess.Popen([sys.executable, "-c", CODE], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(90)
def test_rank_0_names_the_ranks_that_never_came() -> None:
    port = free_port()
    procs = [_rank(0, 3, port, "6"), _rank(1, 3, port, "6")]  # rank 2 never starts
    outs = [p.communicate(timeout=80) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode != 0
        assert "rank(s) 2 of 3 did not join the job" in err, err[-1500:]


@pytest.mark.timeout(90)
def test_a_rank_that_cannot_reach_rank_0_names_the_address() -> None:
    port = free_port()  # nobody listens there
    t0 = time.monotonic()
    p = _rank(1, 2, port, "5")
    _, err = p.communicate(timeout=80)
    assert p.returncode != 0 and time.monotonic() - t0 < 60
    assert f"cannot reach rank 0's rendezvous at 127.0.0.1:{port} within 5 s" in err, err[-1500:]
