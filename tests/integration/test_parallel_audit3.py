"""A pipelined model whose forward is not its units in order: refused on every stage.

A pipeline runs each stage's units in registration order and never the model's own
forward; tests/unit/parallel/test_parallel_audit3.py covers the probe's cases in one
process, this the step that uses it across two real stages.
"""

from __future__ import annotations

import pytest
import torch
from ringtest import run_world
from torch import nn

BATCH, WIDTH = 8, 4


class TanhBetween(nn.Module):
    """Two units with a tanh between them in forward, outside any unit."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def two_steps(model: str) -> list[str]:
    from ringtrain.errors import ConfigError
    from ringtrain.parallel import parallelize

    torch.manual_seed(0)
    net = TanhBetween() if model == "tanh-between" else nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    with torch.no_grad():
        expected = float(nn.functional.mse_loss(net(_batch()[0]), _batch()[1]))
    par = parallelize(net, nn.functional.mse_loss, pipeline=2, microbatches=2)
    outcomes = []
    for _ in range(2):
        x, y = _batch() if par.reads_data else (None, None)
        try:
            loss = par.step(x, y)
            outcomes.append("same loss" if abs(loss - expected) < 1e-6 else f"loss {loss}")
        except ConfigError as exc:
            outcomes.append(str(exc))
    return outcomes


def both_models() -> dict[str, list[str]]:
    return {model: two_steps(model) for model in ("tanh-between", "in-order")}


@pytest.mark.timeout(120)
def test_a_forward_with_computation_between_units_is_refused_on_every_stage() -> None:
    # Before: the stages ran a then b and dropped the tanh: a loss (1.338 instead of the
    # model's 1.207), no error, and training went on for another network. One world for
    # both models (a world's start is most of the cost).
    ranks = run_world(both_models, 2, timeout=100)
    assert ranks[0] == ranks[1]
    for message in ranks[0]["tanh-between"]:  # the probe stays until it passes: every step refuses
        assert "does not call b with the output of a alone" in message, message
        assert "registration order" in message and "\n" not in message
    # A forward that is its units in order runs, and the stages compute its own loss.
    assert ranks[0]["in-order"] == ["same loss"] * 2
