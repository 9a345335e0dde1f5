"""A parameter of the model outside the optimizer's groups, ``add_param_group`` after
wrapping, and backward passes accumulated without ``no_sync()`` (a sweep of user
training patterns against DDP and Horovod).

DDP averages every parameter of its model, whichever optimizer steps it. A script that
builds its optimizer over the head while the backbone trains too, and clips over
``model.parameters()``, clipped by each rank's own backbone gradient under
``rt.DistributedOptimizer(named_parameters=model.named_parameters())``: the ranks'
updates differed (0.06 apart after 4 steps), silently. Adding the backbone later
(``opt.add_param_group``) was a ``ConfigError``, under ``rt`` and ``ringtrain.horovod``
alike. Every case here must equal one process on the global batch, on every rank.
Horovod's contract (``ringtrain.horovod``) leaves a parameter outside the groups alone
until it is added, as Horovod does.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from ringtest import hvd_scenarios, run_world, scenario_results

pytestmark = pytest.mark.timeout(90)

ROWS = 4  # per rank per step
STEPS = 5
ADD_AT = 2  # the step whose start (or, "between", whose backward's end) adds the group
CASES = {  # label: (case, clip over model.parameters())
    "rt-subset": ("never", True),
    "rt-trainable": ("trainable", True),
    "rt-between": ("between", False),
    "hvd-frozen": ("frozen", False),
    "hvd-trainable": ("trainable", False),
}


def _model(frozen: bool) -> torch.nn.Sequential:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model[0].requires_grad_(not frozen)
    return model


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 1, generator=g)


def _train(label: str, wrap: Any, rank: int, n: int) -> dict[str, Any]:
    """The optimizer over the head; the backbone trains all along (its gradient
    accumulates, as under DDP with ``opt.zero_grad()``) and is added at step ADD_AT
    ("trainable"), added after that step's backward() ("between"), frozen until then
    ("frozen"), or never added ("never"). ``wrap(opt, model)`` is the distributed
    wrapper, or None for the one-process reference."""
    case, clip = CASES[label]
    model = _model(frozen=case == "frozen")
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    if wrap is not None:
        opt = wrap(opt, model)
    rows = slice(rank * ROWS, (rank + 1) * ROWS) if wrap is not None else slice(None)
    group = {"params": list(model[0].parameters()), "lr": 0.05, "weight_decay": 0.1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, y = _batch(step, n * ROWS)
            if step == ADD_AT and case in ("trainable", "frozen"):
                model[0].requires_grad_(True)
                opt.add_param_group(group)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            if step == ADD_AT and case == "between":
                opt.add_param_group(group)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "warned": [str(w.message) for w in caught if "frozen when" in str(w.message)]}


def _accumulated(wrap: bool, rank: int, n: int) -> list[torch.Tensor]:
    """DDP's accumulation without ``no_sync()``: two backward passes (half the rows
    each, loss / 2) and one step, under the default ``sync_at="backward"`` and
    ``backward_passes_per_step=1``. DDP exchanges each pass; the sum of the passes'
    averages is the global batch's gradient."""
    import ringtrain as rt

    model = _model(frozen=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if wrap:
        opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    lo, hi = (rank * ROWS, (rank + 1) * ROWS) if wrap else (0, n * ROWS)
    for step in range(3):
        x, y = _batch(step, n * ROWS)
        opt.zero_grad()
        half = (hi - lo) // 2
        for rows in (slice(lo, lo + half), slice(lo + half, hi)):
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / 2).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _world() -> dict[str, Any]:
    def scenarios(hvd: Any) -> list[tuple[str, Any]]:
        import ringtrain as rt

        r, n = hvd.rank(), hvd.size()

        def ddp_like(opt: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
            return rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())

        def head_named(opt: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
            # The added parameters were not named: they take names of their own.
            return rt.DistributedOptimizer(opt, named_parameters=model[2].named_parameters())

        def horovod(opt: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
            return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

        wraps = {"rt-subset": ddp_like, "rt-trainable": ddp_like, "rt-between": head_named,
                 "hvd-frozen": horovod, "hvd-trainable": horovod}
        return [(label, lambda label=label: _train(label, wraps[label], r, n)) for label in CASES] + [
            ("accumulated", lambda: _accumulated(True, r, n))]

    return hvd_scenarios(scenarios)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, init=False, timeout=80)


@pytest.mark.parametrize("label", list(CASES))
def test_trains_as_one_process_on_the_global_batch(world: list[dict[str, Any]], label: str) -> None:
    outs = scenario_results(world, label)
    reference = _train(label, None, 0, 2)["params"]
    for rank, out in enumerate(outs):
        for got, want in zip(out["params"], reference, strict=True):
            assert torch.allclose(got, want, atol=1e-6), (label, rank, float((got - want).abs().max()))
        # Parameters outside the groups are exchanged as DDP exchanges them: no warning.
        assert out["warned"] == [], out["warned"]
    if CASES[label][0] != "never":  # the added group was stepped, not left out
        assert not torch.equal(outs[0]["params"][0], _model(False)[0].weight.detach())


def test_backward_passes_before_step_accumulate_as_under_ddp(world: list[dict[str, Any]]) -> None:
    reference = _accumulated(False, 0, 2)
    for rank, params in enumerate(scenario_results(world, "accumulated")):
        for got, want in zip(params, reference, strict=True):
            assert torch.allclose(got, want, atol=1e-6), (rank, float((got - want).abs().max()))
