"""Tensor plans whose split head is wrong in ways its registration order hides.

A model with an embedding tied to its output layer under tensor parallelism:

Splitting the tied head (``"head": "colwise_gathered"``) untied it: the split layer got a
new DTensor parameter, the embedding kept the whole tensor, and the two trained apart
with no error (the loss left one process's at the second step, 3.9725 against 3.9671;
weights 0.12 apart after 3 SGD steps). It is refused on every rank; a plan that splits
other layers of the tied model trains as one process does.

A ``"colwise"`` output layer registered before a final norm (called after it): the check
of the last registered layer saw the norm, so the loss got each rank's slice of the
logits, silently (cross entropy 0.78 instead of the model's 1.54, labels below t). The
first step watches the split layers' call order and refuses it on every rank, at every
step until one passes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_world
from torch import nn

VOCAB, WIDTH, STEPS = 16, 8, 3


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(x))))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (4, 6), generator=g),
            torch.randint(0, VOCAB, (4, 6), generator=g))


def _train(plan: dict[str, str]) -> Any:
    from ringtrain.errors import ConfigError
    from ringtrain.parallel import parallelize

    torch.manual_seed(0)
    ref = TiedNet()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    torch.manual_seed(0)
    try:
        par = parallelize(TiedNet(), _loss, tensor=2, tensor_plan=plan)
    except ConfigError as exc:
        return str(exc)
    opt = torch.optim.SGD(par.parameters(), lr=0.5)
    loss_gap = 0.0
    for step in range(STEPS):
        x, y = _batch(step)
        loss = par.step(x, y, optimizer=opt)
        ref_loss = _loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_gap = max(loss_gap, abs(loss - float(ref_loss)))
    full = par.full_parameters()
    ref_state = ref.state_dict()
    return {"loss_gap": loss_gap, "names": sorted(full),
            "param_gap": max(float((full[k] - ref_state[k]).abs().max()) for k in full)}


class NormRegisteredLast(nn.Module):
    """The output layer registered before the norm that runs before it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(WIDTH, 16)
        self.head = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.body(x))))


def _head_steps(style: str) -> list[Any]:
    from ringtrain.errors import ConfigError
    from ringtrain.parallel import parallelize

    torch.manual_seed(0)
    ref = NormRegisteredLast()
    torch.manual_seed(0)
    par = parallelize(NormRegisteredLast(), nn.functional.cross_entropy, tensor=2,
                      tensor_plan={"body": "colwise_gathered", "head": style})
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randint(0, 2, (8,), generator=g)
    expected = float(nn.functional.cross_entropy(ref(x), y))
    outcomes: list[Any] = []
    for _ in range(2):
        try:
            outcomes.append(abs(par.step(x, y) - expected) < 1e-5)
        except ConfigError as exc:
            outcomes.append(str(exc))
    return outcomes


def _pair_step(plan: dict[str, str]) -> str:
    """The first step's error (type: first line) for a plan whose pairs are wrong."""
    from ringtrain.parallel import parallelize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 4))
    par = parallelize(model, nn.functional.cross_entropy, tensor=2, tensor_plan=plan)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randint(0, 4, (8,), generator=g)
    try:
        par.step(x, y)
    except Exception as exc:  # noqa: BLE001 - the error's type and text are the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def all_plans() -> dict[str, Any]:
    return {"head": _train({"head": "colwise_gathered"}),
            "mid": _train({"mid": "colwise_gathered"}),
            "colwise head": _head_steps("colwise"),
            # Named before the layer runs (DTensor's matmul would fail inside it first).
            "rowwise first": _pair_step({"0": "rowwise", "2": "colwise_gathered"}),
            "gathered after colwise": _pair_step({"0": "colwise", "2": "colwise_gathered"})}


@pytest.mark.timeout(120)
def test_a_tied_or_misordered_head_is_not_split_silently_under_tensor_parallelism() -> None:
    ranks = run_world(all_plans, 2, timeout=100)
    for out in ranks:
        assert isinstance(out["head"], str), out["head"]
        assert "head.weight is tied to embed.weight" in out["head"]
        # The tied weight stays one parameter when only other layers are split.
        assert out["mid"]["names"] == ["embed.weight", "mid.bias", "mid.weight"]
        assert out["mid"]["loss_gap"] < 1e-5 and out["mid"]["param_gap"] < 1e-5, out["mid"]
    # The colwise head called last: refused on every rank, at every step.
    for out in ranks:
        for message in out["colwise head"]:
            assert isinstance(message, str), out["colwise head"]
            assert "head ('colwise') is the last split layer the model's forward calls" in message
            assert "\n" not in message
    for out in ranks:
        assert out["rowwise first"].startswith("ConfigError: tensor plan: 0 ('rowwise') is called first"), out
        assert out["gathered after colwise"].startswith(
            "ConfigError: tensor plan: 2 ('colwise_gathered') is called after 0 ('colwise')"), out
