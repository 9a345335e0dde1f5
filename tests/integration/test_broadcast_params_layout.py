"""``rt.broadcast_`` of a parameter that is not contiguous, on one 2-rank Gloo world.

torch's ``dist.broadcast(param)`` writes a parameter outside autograd whatever its
layout. ``rt.broadcast_`` stages a non-contiguous tensor and copies the result back:
that copy raised "a leaf Variable that requires grad is being used in an in-place
operation" on every rank for a channels_last conv weight or a transposed weight.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_scenarios, run_world, scenario_results

N = 2
ROOT = 1


def _params(rank: int) -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(rank)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    return {"channels_last": conv.weight,
            "transposed": torch.nn.Parameter(torch.randn(4, 6).t()),
            "strided": torch.nn.Parameter(torch.randn(4, 10)[:, ::3])}


def _broadcast(kind: str) -> dict[str, Any]:
    import ringtrain as rt

    p = _params(rt.rank())[kind]
    stride = p.stride()
    out = rt.broadcast_(p, root_rank=ROOT)
    after = rt.allreduce(torch.ones(1), op=rt.Sum).item()
    return {"value": p.detach().clone(), "same": out is p, "requires_grad": p.requires_grad,
            "stride": p.stride() == stride, "after": after}


def _world() -> dict[str, Any]:
    return run_scenarios([(kind, lambda k=kind: _broadcast(k))  # type: ignore[misc]
                          for kind in ("channels_last", "transposed", "strided")])


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, N, timeout=40, env={"RINGTRAIN_STALL_TIMEOUT": "4"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["channels_last", "transposed", "strided"])
def test_a_non_contiguous_parameter_takes_the_roots_values_in_place(world: list[dict[str, Any]],
                                                                     kind: str) -> None:
    expected = _params(ROOT)[kind].detach()
    for got in scenario_results(world, kind, after=float(N)):
        assert got["same"] and got["requires_grad"] and got["stride"], got
        assert torch.equal(got["value"], expected), kind
