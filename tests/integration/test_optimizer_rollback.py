"""A rollback through the optimizer: ``backward()``, then ``opt.load_state_dict(saved)``
and ``zero_grad()``, as Horovod's ``load_state_dict`` allows (it drops the step in
progress and its accumulation count). The step rolled back must leave no trace: every
rank ends where a run without it ends, under ``hvd.DistributedOptimizer`` (exchange at
``step()``) and ``rt.DistributedOptimizer`` (exchange in ``backward()``), with and
without gradient accumulation.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from ringtest import hvd_scenarios, run_world, scenario_results

pytestmark = pytest.mark.timeout(90)

ROWS = 4  # per rank per pass
STEPS = 3
ROLLED_BACK = 1  # the step whose passes are rolled back, then run again


def _batch(step: int, k: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * k + rank)
    return torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 1, generator=g)


def _train(how: str, passes: int, rollback: bool, rank: int, n: int) -> list[torch.Tensor]:
    import ringtrain as rt
    import ringtrain.horovod as hvd

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrap: Any = hvd.DistributedOptimizer if how == "hvd" else rt.DistributedOptimizer
    opt = wrap(inner, named_parameters=model.named_parameters(), backward_passes_per_step=passes)
    for step in range(STEPS):
        if rollback and step == ROLLED_BACK:
            saved = copy.deepcopy(opt.state_dict())
            opt.zero_grad()
            # Some of a step's passes (all of them but none with accumulation), then undone.
            for k in range(max(1, passes - 1)):
                x, y = _batch(99, k, rank, n)
                (torch.nn.functional.mse_loss(model(x), y) / passes).backward()
            opt.load_state_dict(saved)
        opt.zero_grad()
        for k in range(passes):
            x, y = _batch(step, k, rank, n)
            (torch.nn.functional.mse_loss(model(x), y) / passes).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


CASES = [(how, passes) for how in ("hvd", "rt") for passes in (1, 2)]


def _world() -> dict[str, Any]:
    def scenarios(hvd: Any) -> list[tuple[str, Any]]:
        r, n = hvd.rank(), hvd.size()
        return [(f"{how}-{passes}-{rollback}",
                 lambda how=how, passes=passes, rollback=rollback: _train(how, passes, rollback, r, n))
                for how, passes in CASES for rollback in (False, True)]

    return hvd_scenarios(scenarios)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, init=False, timeout=80)


@pytest.mark.parametrize("how,passes", CASES, ids=[f"{h}-passes{p}" for h, p in CASES])
def test_a_step_rolled_back_by_load_state_dict_leaves_no_trace(
        world: list[dict[str, Any]], how: str, passes: int) -> None:
    plain = scenario_results(world, f"{how}-{passes}-False")
    rolled = scenario_results(world, f"{how}-{passes}-True")
    for rank in range(2):
        for a, b, first in zip(rolled[rank], plain[rank], plain[0], strict=True):
            assert torch.allclose(a, b, atol=1e-6), (rank, float((a - b).abs().max()))
            assert torch.equal(b, first), rank  # the replicas agree
