"""Compiled autograd (``torch._dynamo.config.compiled_autograd = True``) with
rt.DistributedOptimizer's default ``sync_at="backward"``.

Compiled autograd runs the optimizer's gradient hooks untraced (they are) but drops the
callback they queue for the end of the backward, so nothing combined ``.grad`` before
``backward()`` returned: ``.grad`` was a view of the buffer still being summed, a clip
between ``backward()`` and ``step()`` scaled it mid-exchange, each rank by its own norm
(0.07 from one process after 3 steps; with ``backward_passes_per_step=2`` the replicas
drifted 0.05 apart), silently. Such a step goes as under ``sync_at="step"``: ``.grad``
stays local until ``step()`` or ``synchronize()``, so a script that steps (or
synchronizes, then clips) trains as one process on the global batch, and one that
changes the gradients before that gets an error naming compiled autograd and the fix.
Checked by hand, not here (each compiled-autograd capture costs seconds): accumulation
with ``backward_passes_per_step=2`` (with and without Horovod's clip recipe) trains as
one process; a second backward before ``step()`` is an error that names compiled
autograd; ``hvd.DistributedOptimizer`` and ``sync_at="step"`` train as one process.

Dynamo's ``eager`` backend: the hooks and the engine are what is tested, not code
generation. One 2-rank world runs every scenario.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_scenarios, run_world, scenario_results
from trainhelp import seeded_batch as _batch
from trainhelp import tiny_model as _model

# `make test-system` (docs/testing.md): its one compiled-autograd capture takes about 10 s,
# too long for the fast tier's budget.
pytestmark = pytest.mark.system

ROWS = 4  # per rank
STEPS = 3
TOLERANCE = 1e-6


def _reference(clip: bool) -> list[torch.Tensor]:
    """One process, eager autograd, every rank's rows."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step, 2 * ROWS)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def _train(backward: Any, clip: str) -> dict[str, Any]:
    """``clip``: "" (none), "direct" (between backward and step, DDP's way), "synchronize"
    (Horovod's recipe)."""
    import ringtrain as rt

    model = _model()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters())
    rows = slice(rt.rank() * ROWS, (rt.rank() + 1) * ROWS)
    torch._dynamo.config.compiled_autograd = True
    try:
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(step, rt.size() * ROWS)
            backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
            if clip == "synchronize":
                opt.synchronize()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if clip == "synchronize":
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
    finally:
        torch._dynamo.config.compiled_autograd = False
    from torch._dynamo.utils import counters

    return {"params": [p.detach().clone() for p in model.parameters()],
            "captures": counters["compiled_autograd"]["captures"]}


def _world() -> dict[str, Any]:
    # Compiled once (torch.compile reads the compiled_autograd flag): compiled autograd
    # captures the backward once and reuses it in every scenario (the same model, one
    # pass a step; the hooks are inputs). A capture costs seconds on the test machine.
    torch._dynamo.config.compiled_autograd = True
    backward = torch.compile(_backward, backend="eager")
    torch._dynamo.config.compiled_autograd = False
    return run_scenarios([
        ("plain", lambda: _train(backward, "")),
        ("synchronize clip", lambda: _train(backward, "synchronize")),
        ("direct clip", lambda: _train(backward, "direct")),
    ])


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, timeout=90, env={"RINGTRAIN_PROGRESS": "0"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("label", "clip"), [("plain", False), ("synchronize clip", True)])
def test_compiled_autograd_trains_as_one_process(world: list[dict[str, Any]], label: str, clip: bool) -> None:
    want = _reference(clip)
    for rank, got in enumerate(scenario_results(world, label)):
        assert got["captures"] >= 1, "compiled autograd did not run"
        for g, w in zip(got["params"], want, strict=True):
            torch.testing.assert_close(g, w, atol=TOLERANCE, rtol=TOLERANCE, msg=lambda m, r=rank: f"rank {r}: {m}")


@pytest.mark.timeout(120)
def test_a_change_to_gradients_before_the_exchange_ends_is_an_error(world: list[dict[str, Any]]) -> None:
    # Without the error the clip scaled the buffer while it was being summed: each rank
    # clipped by another norm, and the weights ended 0.07 from one process's.
    for message in (o["direct clip"] for o in world):
        assert isinstance(message, str) and message.startswith("OptimizerUsageError"), message
        assert "compiled autograd" in message and "optimizer.synchronize()" in message, message
