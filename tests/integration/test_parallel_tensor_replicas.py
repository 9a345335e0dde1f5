"""Tensor parallelism: the layers every tensor rank holds whole stay one layer, and the
model's output reaches the loss whole.

One world of two ranks (``tensor=2``) runs every scenario; the test process trains the
same tiny model alone:

- ranks seeded per rank after ``parallelize`` (``torch.manual_seed(seed + rank)``, as DDP
  scripts do) with a dropout after the rowwise layer drew different masks on the two
  tensor ranks, and the gradients of what both hold whole (the rowwise bias, the norm,
  the head) are never reduced over the tensor group: those copies trained apart
  silently (0.03 to 0.05 apart after three steps). It is a ConfigError at the first
  step in training mode; a dropout between the split pair may differ by rank (the
  rowwise all-reduce makes what follows the same), and one seed is fine;
- a head split ``"colwise"`` handed the loss each rank's slice of the logits (a shape
  error in ``cross_entropy``, a wrong value in a loss that broadcasts): the plan is
  refused, and ``"colwise_gathered"`` trains as one process does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from parallelhelp import token_batch, token_loss
from ringtest import run_scenarios, run_world, scenario_results
from torch import nn

VOCAB, WIDTH, HIDDEN, BATCH, SEQ, STEPS = 16, 8, 16, 4, 4, 2
PLAN = {"1": "colwise", "3": "rowwise"}


def _model(inner: float = 0.0, outer: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, HIDDEN),
                         nn.Dropout(inner), nn.Linear(HIDDEN, WIDTH), nn.Dropout(outer),
                         nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))


_loss = token_loss


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, BATCH, SEQ, VOCAB)


def _whole(par: Any) -> dict[str, torch.Tensor]:
    """This rank's copies of the parameters it holds whole (not split over the group)."""
    out = {}
    for name, p in par.module.named_parameters():
        if not any(not pl.is_replicate() for pl in getattr(p, "placements", ())):
            out[name] = (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
    return out


def _train(inner: float, outer: float, per_rank_seed: bool,
           modes: tuple[bool, ...] = (True,) * STEPS) -> dict[str, Any]:
    from ringtrain.errors import ConfigError
    from ringtrain.parallel import parallelize

    par = parallelize(_model(inner, outer), _loss, tensor=2, tensor_plan=PLAN)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    torch.manual_seed(100 + par.rank if per_rank_seed else 100)
    done = []
    try:
        for step, training in enumerate(modes):
            par.module.train(training)
            par.step(*_batch(step), optimizer=opt)
            done.append(step)
    except ConfigError as exc:
        error = str(exc)
    else:
        error = ""
    after = torch.ones(1)
    torch.distributed.all_reduce(after)  # the ranks are still in step
    return {"error": error, "done": done, "whole": _whole(par), "after": float(after)}


def _head(style: str) -> dict[str, Any]:
    from ringtrain.errors import ConfigError
    from ringtrain.parallel import parallelize

    try:
        par = parallelize(_model(), _loss, tensor=2, tensor_plan={**PLAN, "6": style})
    except ConfigError as exc:
        return {"error": str(exc)}
    opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(par.step(*_batch(step)))
        norms.append(par.clip_grad_norm_(0.5))
        par.update(opt)
    return {"error": "", "losses": losses, "norms": norms, "params": par.full_parameters()}


def _world() -> dict[str, Any]:
    return run_scenarios([
        ("one seed", lambda: _train(0.0, 0.5, per_rank_seed=False)),
        ("dropout inside the pair", lambda: _train(0.5, 0.0, per_rank_seed=True)),
        ("seeded per rank", lambda: _train(0.0, 0.5, per_rank_seed=True)),
        ("eval first", lambda: _train(0.0, 0.5, per_rank_seed=True, modes=(False, True))),
        ("colwise head", lambda: _head("colwise")),
        ("gathered head", lambda: _head("colwise_gathered")),
    ])


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, timeout=100)


def _apart(outs: list[dict[str, Any]]) -> float:
    a, b = (out["whole"] for out in outs)
    assert a.keys() == b.keys() and {"3.bias", "5.weight", "6.weight"} <= a.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label", ["one seed", "dropout inside the pair"])
def test_tensor_ranks_that_draw_alike_for_whole_layers_train_on(
        world: list[dict[str, Any]], label: str) -> None:
    # One seed: the same masks. Per-rank seeds with the dropout between colwise and
    # rowwise: each rank drops its own hidden units, which the rowwise all-reduce sums.
    outs = scenario_results(world, label, after=2.0)
    for out in outs:
        assert out["error"] == "" and out["done"] == list(range(STEPS)), out["error"]
    assert _apart(outs) == 0.0


@pytest.mark.timeout(120)
def test_a_dropout_outside_the_split_layers_seeded_per_rank_is_refused(
        world: list[dict[str, Any]]) -> None:
    # Before: no error; 3.bias, the LayerNorm and the head ended 0.03-0.05 apart.
    for out in scenario_results(world, "seeded per rank", after=2.0):
        assert out["done"] == [], out
        message = out["error"]
        assert message.startswith("ranks 0 and 1 (one tensor group) each hold all of 3.bias"), \
            message
        assert "random number generators differ" in message, message
        assert "torch.manual_seed(seed + par.data_rank)" in message and "\n" not in message


@pytest.mark.timeout(120)
def test_the_comparison_waits_for_the_first_step_in_training_mode(
        world: list[dict[str, Any]]) -> None:
    # A first step in eval() mode draws nothing; the dropout trains from the second.
    for out in scenario_results(world, "eval first", after=2.0):
        assert out["done"] == [0], out
        assert "random number generators differ" in out["error"], out["error"]


@pytest.mark.timeout(120)
def test_a_head_split_by_columns_alone_is_refused(world: list[dict[str, Any]]) -> None:
    # Before: the loss got each rank's 8 of the 16 logits ("Expected input batch_size
    # (32) to match target batch_size (16)"; an elementwise loss that broadcasts took
    # the slice silently).
    for out in scenario_results(world, "colwise head"):
        assert out["error"] == (
            "tensor plan: 6 is the model's last layer and 'colwise' would hand the loss "
            "each tensor rank's slice of its output features; plan it as "
            "'colwise_gathered' (split, output gathered whole) or leave it out of the plan")


@pytest.mark.timeout(120)
def test_a_head_split_with_its_output_gathered_trains_as_one_process(
        world: list[dict[str, Any]]) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        loss = _loss(model(_batch(step)[0]), _batch(step)[1])
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    for out in scenario_results(world, "gathered head"):
        assert out["error"] == ""
        assert out["losses"] == pytest.approx(losses, abs=1e-5)
        assert out["norms"] == pytest.approx(norms, rel=1e-5)
        for name, value in model.named_parameters():
            assert torch.allclose(out["params"][name], value, atol=1e-5), name
