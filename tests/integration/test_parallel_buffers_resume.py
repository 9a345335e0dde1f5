"""Buffers through a pipeline, a checkpoint of a fresh optimizer, a batch norm that
starts training after ``parallelize``: each as in one process, or said.

One world of two ranks runs every scenario; the test process trains the same tiny
model alone:

- a BatchNorm on pipeline stage 1 (two stages, one micro-batch, so it sees the whole
  batch as in one process): torch's schedule runs each stage's forward once more at
  the first step to find the activation shapes, on ``torch.empty()`` buffers past the
  first stage, and the running statistics took that memory in (NaN and 1e34 after one
  step) and counted a batch more;
- ``par.save(path, opt)`` of an optimizer that never stepped (a checkpoint at step 0)
  was refused; it saves, and ``par.load`` at another layout gives the optimizer back
  fresh, so the resumed run trains as one process that never stopped;
- a BatchNorm in eval() mode at ``parallelize`` and switched to train() after it
  trained on each data rank's shard without the warning ``parallelize`` gives.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from parallelhelp import token_batch, token_loss
from ringtest import run_scenarios, run_world, scenario_results
from torch import nn

VOCAB, WIDTH, BATCH, SEQ, STEPS = 16, 8, 8, 4, 3


def _model(norm: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), norm or nn.BatchNorm1d(SEQ),
                         nn.Linear(WIDTH, VOCAB))


_loss = token_loss


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, BATCH, SEQ, VOCAB)


def _alone(norm: nn.Module | None = None) -> dict[str, Any]:
    model = _model(norm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "buffers": dict(model.named_buffers()),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipelined_batch_norm() -> dict[str, Any]:
    from ringtrain.parallel import parallelize

    par = parallelize(_model(), _loss, pipeline=2, microbatches=1, schedule="gpipe",
                      split=["4"])
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = _batch(step) if par.reads_data else (None, None)
        par.step(x, y, optimizer=opt)
    return {n: b.clone() for n, b in par.module.named_buffers()}


def _resumed_from_step_zero(root: str) -> dict[str, Any]:
    from ringtrain.parallel import parallelize

    # Saved by two pipeline stages before the first update, loaded by two sharded ranks.
    par = parallelize(_model(nn.LayerNorm(WIDTH)), _loss, pipeline=2, microbatches=2)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    par.save(f"{root}/step-0.dcp", opt)
    par = parallelize(_model(nn.LayerNorm(WIDTH)), _loss, shard=True)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    par.load(f"{root}/step-0.dcp", opt)
    fresh = not opt.state
    losses = []
    half = BATCH // 2
    for step in range(STEPS):
        x, y = _batch(step)
        mine = slice(par.data_rank * half, (par.data_rank + 1) * half)
        losses.append(par.step(x[mine], y[mine], optimizer=opt))
    return {"fresh": fresh, "losses": losses, "params": par.full_parameters()}


def _batch_norm_trained_later() -> list[str]:
    from ringtrain.parallel import parallelize

    said: list[list[str]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        par = parallelize(_model().eval(), _loss, shard=False)
        x, y = _batch(0)
        for train in (False, True, False, True):  # evaluate, train, evaluate, train
            par.module.train(train)
            par.step(x[:4], y[:4])
            said.append([str(w.message) for w in caught if "BatchNorm" in str(w.message)])
    return [f"{len(found)}: {found[-1] if found else ''}" for found in said]


def _world(root: str) -> dict[str, Any]:
    return run_scenarios([
        ("pipeline", _pipelined_batch_norm),
        ("resume", lambda: _resumed_from_step_zero(root)),
        ("trained later", _batch_norm_trained_later),
    ])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(_world, 2, str(tmp_path_factory.mktemp("buffers")), timeout=100)


@pytest.mark.timeout(120)
def test_a_pipelined_batch_norm_keeps_one_process_running_statistics(
        world: list[dict[str, Any]]) -> None:
    # Before: stage 1's running_mean [nan, 1.1e34, 1.3e35, 5.4e34], running_var
    # [nan, inf, inf, inf], num_batches_tracked 4 after 3 steps.
    ref = _alone()["buffers"]
    stage0, stage1 = scenario_results(world, "pipeline")
    assert stage0 == {}  # the embedding and the linears: no buffers
    assert stage1.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.allclose(stage1[name], value, atol=1e-6), (name, stage1[name], value)


@pytest.mark.timeout(120)
def test_an_optimizer_saved_before_its_first_update_resumes_fresh(
        world: list[dict[str, Any]]) -> None:
    # Before: par.save(path, opt) raised ConfigError ("the optimizer has not stepped yet").
    ref = _alone(nn.LayerNorm(WIDTH))
    for out in scenario_results(world, "resume"):
        assert out["fresh"]
        assert out["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        assert max(float((out["params"][k] - v).abs().max())
                   for k, v in ref["params"].items()) < 1e-5


@pytest.mark.timeout(120)
def test_a_batch_norm_switched_to_training_after_parallelize_is_said_once(
        world: list[dict[str, Any]]) -> None:
    # Before: no warning at all (parallelize looked only at the modes it was given).
    for said in scenario_results(world, "trained later"):
        assert said[0] == "0: "  # evaluating: nothing to say
        assert said[1].startswith("1: 4 is a BatchNorm1d in training mode and this layout "
                                  "(data 2)"), said[1]
        assert said[2].startswith("1: ") and said[3].startswith("1: "), said  # once
