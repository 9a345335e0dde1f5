"""A parameter no rank has a gradient for keeps ``.grad`` None under DDP's semantics.

DDP leaves a globally unused parameter's gradient alone (None), so the optimizer skips
it, as one process does. ringtrain's exchange gave it a zero gradient, and AdamW's
weight decay moved it (0.08 in 3 steps) on every rank. A parameter that one rank used
is averaged as before (the other rank contributes zeros), on every rank alike.
Horovod's contract (``sync_at="step"``) gives zeros, as Horovod does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_world

pytestmark = pytest.mark.timeout(120)


def _train() -> dict[str, Any]:
    import ringtrain as rt

    out: dict[str, Any] = {}
    cases = [("backward", "native", None), ("backward", "ring", None), ("backward", "native", "fp16"),
             ("step", "native", None)]
    for sync_at, strategy, compression in cases:
        torch.manual_seed(0)
        used = torch.nn.Linear(2, 2)
        mine = torch.nn.Linear(2, 2)  # used by rank 1 only
        idle = torch.nn.Linear(2, 2)  # used by no rank
        named = [(f"{m}.{n}", p) for m, mod in (("used", used), ("mine", mine), ("idle", idle))
                 for n, p in mod.named_parameters()]
        kwargs: dict[str, Any] = {}
        if compression == "fp16":
            kwargs["compression"] = rt.Compression.fp16
        opt = rt.DistributedOptimizer(torch.optim.AdamW([p for _, p in named], lr=0.1, weight_decay=0.5),
                                      named_parameters=named, strategy=strategy, sync_at=sync_at,
                                      **kwargs)
        start = idle.weight.detach().clone()
        grads: list[Any] = []
        for _ in range(3):
            opt.zero_grad()
            loss = used(torch.ones(1, 2)).sum()
            if rt.rank() == 1:
                loss = loss + mine(torch.ones(1, 2)).sum()
            loss.backward()
            opt.step()
            grads = [None if p.grad is None else p.grad.clone() for p in (idle.weight, mine.weight)]
        out[f"{sync_at}-{strategy}-{compression}"] = {
            "idle_grad": grads[0], "mine_grad": grads[1],
            "idle_moved": float((idle.weight - start).abs().max()),
            "params": [p.detach().clone() for _, p in named],
        }
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_train, 2, timeout=100)


@pytest.mark.parametrize("case", ["backward-native-None", "backward-ring-None", "backward-native-fp16"])
def test_a_parameter_no_rank_used_keeps_no_gradient_and_stays_put(world: list[dict[str, Any]],
                                                                    case: str) -> None:
    for rank in world:
        got = rank[case]
        assert got["idle_grad"] is None and got["idle_moved"] == 0.0
        # Used on rank 1 only: averaged (rank 0 gave zeros), the same on both ranks.
        assert torch.allclose(got["mine_grad"], torch.full((2, 2), 0.5))
    for a, b in zip(world[0][case]["params"], world[1][case]["params"], strict=True):
        assert torch.equal(a, b)


def test_horovods_contract_gives_it_zeros_as_horovod_does(world: list[dict[str, Any]]) -> None:
    for rank in world:
        got = rank["step-native-None"]
        assert got["idle_grad"] is not None and torch.equal(got["idle_grad"], torch.zeros(2, 2))
        assert got["idle_moved"] > 0  # AdamW's weight decay, as under Horovod
