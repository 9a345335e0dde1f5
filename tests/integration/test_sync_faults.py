"""Every fault ends in the stated error within the stall timeout, never in a hang.

A rank that skips a step, exits early, raises, or just does not come is a StallError on
the waiting ranks naming it and the tensor being exchanged. (Mismatches of shape, dtype
and settings are checked in test_sync_strategies.py, in the world shared there.)

Each fault needs a world of its own (the fault ends it), and each mostly waits out the
stall timeout, so the worlds start together (``worlds``) and wait side by side.
"""

from __future__ import annotations

import time

import pytest
import torch
from ringtest import World, start_world
from test_sync_strategies import STALL, caught, optimizer

ENV = {"RINGTRAIN_STALL_TIMEOUT": str(STALL)}
SLACK = 15.0  # seconds: far above what scheduling on a loaded machine adds; a hang is 50


def _faulty(strategy: str, fault: str, bad: int, steps: int = 4):
    import ringtrain as rt

    r = rt.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = optimizer(model, strategy=strategy, fusion_mb=0.0001)  # two buckets
    # Ranks finish importing at different times on a loaded machine; start together so
    # only the injected fault can exceed the short stall timeout.
    rt.barrier()

    def train() -> None:
        for step in range(steps):
            if r == bad and step == 2:
                if fault == "skip":
                    continue
                if fault == "exit":
                    raise SystemExit(0)  # leaves fn; the harness shuts down and exits
                if fault == "raise":
                    raise RuntimeError("user code failed on this rank")
                if fault == "late":
                    time.sleep(STALL + 2)
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()

    return caught(train)


@pytest.fixture(scope="module")
def worlds() -> dict[str, World]:
    started = {
        "skip": start_world(_faulty, 2, "native", "skip", 1, env=ENV, timeout=50, expect_failure=True),
        "exit": start_world(_faulty, 3, "ring", "exit", 2, env=ENV, timeout=50, expect_failure=True),
        "raise": start_world(_faulty, 2, "ps", "raise", 0, env=ENV, timeout=50, expect_failure=True),
        "late": start_world(_faulty, 2, "native", "late", 1, env=ENV, timeout=50, expect_failure=True),
        "absent": start_world(_absent, 2, env=ENV, timeout=50, expect_failure=True),
    }
    return started


def _check_stall(result: object, bad: int, rank: int) -> str:
    assert isinstance(result, tuple), f"rank {rank}: {result}"
    kind, msg, seconds = result
    assert kind == "StallError", f"rank {rank}: {kind}: {msg}"
    assert "bucket" in msg, msg  # the tensor being exchanged
    assert f"rank {bad}" in msg, msg
    # The stall timer runs from the exchange the fault left incomplete; the slack is
    # for the steps before it, with five worlds sharing the cores.
    assert seconds < STALL + SLACK, f"rank {rank} took {seconds:.1f} s"
    return msg


@pytest.mark.timeout(60)
def test_rank_that_skips_a_step_is_named_at_the_missing_exchange(worlds: dict[str, World]) -> None:
    results = worlds["skip"].results()
    msg = _check_stall(results[0], 1, 0)
    # Rank 1 did one exchange fewer per bucket and left. Whether rank 0 waits out the
    # stall timeout or its exchange fails at once because rank 1 left ("a peer went
    # away"), rank 1 wrote its last arrival before leaving: its last exchange is named.
    assert "missing rank: rank 1 (last arrived at 'bucket1" in msg and "for the 3rd time" in msg, msg
    assert results[1] == ("no error", "", pytest.approx(results[1][2]))


@pytest.mark.timeout(60)
def test_rank_that_exits_early_is_named_by_the_others(worlds: dict[str, World]) -> None:
    results = worlds["exit"].results()
    msg = _check_stall(results[0], 2, 0)
    assert "exited" in msg or "the connection to rank 2 broke" in msg
    # Rank 1 waits on a ring that cannot complete; it names rank 2 unless rank 0 (the
    # store's host) has already gone too, in which case it names the broken peer.
    assert isinstance(results[1], tuple) and results[1][0] == "StallError", results[1]
    assert results[1][2] < STALL + SLACK


@pytest.mark.timeout(60)
def test_parameter_server_that_raises_is_named_by_its_workers(worlds: dict[str, World]) -> None:
    # Rank 0 is the single server and also hosts the job's store: the worst rank to lose.
    results = worlds["raise"].results()
    msg = _check_stall(results[1], 0, 1)
    # Depending on how far rank 0's exit got: its broken connection, its exit mark, or
    # the unreachable store is what rank 1 can report; each names rank 0.
    assert any(s in msg for s in ("the connection to rank 0 broke", "missing rank: rank 0",
                                  "rank 0, which hosts the job's store")), msg
    assert "user code failed on this rank" in str(results[0])


@pytest.mark.timeout(60)
def test_rank_that_does_not_come_times_out_with_the_missing_rank(worlds: dict[str, World]) -> None:
    results = worlds["late"].results()
    msg = _check_stall(results[0], 1, 0)
    assert f"did not complete on rank 0 within {STALL:g} s" in msg
    assert "rank 1 (last arrived at 'bucket1" in msg and "exited" not in msg
    assert results[0][2] >= STALL  # a real timeout, not a connection error


def _absent() -> object:
    import ringtrain as rt
    from ringtrain import sync

    if rt.rank() == 1:
        time.sleep(2 * STALL + 3)  # e.g. stuck loading data: never reaches an exchange
        return "absent"
    # The ring's process group is built inside the first exchange: its rendezvous must
    # give up after stall_timeout too.
    ring = caught(lambda: rt.allreduce(torch.ones(10), name="first", algorithm=sync.Ring()))
    model = torch.nn.Linear(4, 2)
    opt = optimizer(model, strategy="ring")

    def step() -> None:
        model(torch.ones(1, 4)).sum().backward()
        opt.step()

    return ring, caught(step)


@pytest.mark.timeout(60)
def test_rank_missing_from_the_first_exchange_is_a_stall_not_a_hang(worlds: dict[str, World]) -> None:
    ring, first_step = worlds["absent"].results()[0]
    assert ring[0] == "StallError" and "'first (allreduce check)'" in ring[1], ring
    assert "rank 1 (never reached an exchange)" in ring[1]
    assert STALL <= ring[2] < STALL + SLACK
    # With the optimizer the first-step signature check is where rank 1 is missed.
    assert first_step[0] == "StallError", first_step
    assert "signature check" in first_step[1] and "'bias' .. 'weight'" in first_step[1]
    assert "rank 1 did not arrive within 3 s" in first_step[1]
