"""A model whose embedding is tied to its output layer trains under sharded and
replicated data parallelism as in one process.

Before, each unit became its own FSDP2 group, so the tied weight was managed by two
sibling groups and the first step raised FSDP2's ValueError ("shared with a parameter
already managed by another FSDP group"), which the user cannot act on through
``parallelize``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_world
from test_parallel_common import max_difference
from torch import nn

VOCAB, WIDTH, BATCH, STEPS = 16, 8, 8, 5


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 and nanoGPT do

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(x))))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _train(layout: dict[str, Any]) -> dict[str, Any] | None:
    from ringtrain.parallel import parallelize

    torch.manual_seed(0)
    par = parallelize(TiedNet(), _loss, **layout)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    losses = []
    n = BATCH // par.data_size
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (BATCH, 4), generator=g)
        y = torch.randint(0, VOCAB, (BATCH, 4), generator=g)
        mine = slice(par.data_rank * n, (par.data_rank + 1) * n)
        losses.append(par.step(x[mine], y[mine], optimizer=opt))
    params = par.full_parameters()
    return {"losses": losses, "params": params} if par.rank == 0 else None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "replicated"])
def test_tied_embedding_trains_as_one_process(shard: bool) -> None:
    reference = _train({})
    assert reference is not None
    got = run_world(_train, 2, {"shard": shard}, timeout=120)[0]
    assert max(abs(a - b) for a, b in zip(got["losses"], reference["losses"], strict=True)) < 1e-5
    assert max_difference(got["params"], reference["params"]) < 1e-5
    assert reference["losses"][-1] < reference["losses"][0]  # it trained
