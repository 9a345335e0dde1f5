"""GradScaler with a fused optimizer, and broadcasts of unlike layouts (an audit of the
optimizer wrappers against DDP and Horovod).

``torch.amp.GradScaler.step(opt)`` on a fused optimizer (``Adam(fused=True)``,
``SGD(fused=True)``) sets ``opt.grad_scale`` and ``opt.found_inf`` for the fused
kernel, which reads them from the optimizer that steps. Set on the wrapper, they never
reached the wrapped optimizer: the update used gradients still multiplied by the scale
(SGD's parameters 8.5e5 off after 3 steps) and stepped on an overflow (NaN), under
``rt.DistributedOptimizer`` and ``hvd.DistributedOptimizer`` alike. DDP trains
normally; every case here must equal it.

``rt.broadcast_parameters`` fuses tensors by dtype, and the fused buffers compared only
their lengths: a (3, 2) tensor where the root has (2, 3) took the root's values
reshaped, silently (Horovod refuses it); and a mapping was taken in its own order, where
Horovod sorts it by name.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from ringtest import error_of, hvd_scenarios, run_world, scenario_results

pytestmark = pytest.mark.timeout(90)

ROWS = 4  # per rank per step
STEPS = 4
OVERFLOW = 2  # the step whose loss is inf on rank 0 only: no rank updates


def _model() -> torch.nn.Module:
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _train(kind: str, how: str, rank: int, n: int) -> list[torch.Tensor]:
    """GradScaler, unscale_ and clip, as PyTorch's AMP recipe; ``how``: "ddp", "rt"
    (rt.DistributedOptimizer's defaults) or "hvd" (Horovod's recipe: synchronize(),
    unscale_, clip, step inside skip_synchronize())."""
    import ringtrain as rt

    model = _model()
    opt: Any = getattr(torch.optim, kind)(model.parameters(), lr=0.05, fused=True)
    forward: Any = model
    if how == "ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model)
    elif how == "rt":
        opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    else:
        import ringtrain.horovod as hvd

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(n * ROWS, 4, generator=g), torch.randn(n * ROWS, 1, generator=g)
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(x[rows]), y[rows])
        if step == OVERFLOW and rank == 0:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if how == "hvd":
            opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if how == "hvd":
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()]


def _broadcasts(rank: int) -> dict[str, Any]:
    import ringtrain as rt

    swapped = {"w": torch.arange(6.0).reshape(2, 3) if rank == 0 else torch.zeros(3, 2)}
    refused = error_of(lambda: rt.broadcast_parameters(swapped, root_rank=0))
    # The same names, inserted in another order on rank 1.
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    values = {"a": torch.full((3,), 1.0), "b": torch.full((3,), 2.0)}
    ordered = {k: values[k].clone() if rank == 0 else torch.zeros(3) for k in names}
    rt.broadcast_parameters(ordered, root_rank=0)
    return {"refused": refused, "kept": swapped["w"], "ordered": ordered}


def _world() -> dict[str, Any]:
    def scenarios(hvd: Any) -> list[tuple[str, Any]]:
        r, n = hvd.rank(), hvd.size()
        cases = [(f"{how}-{kind}", lambda how=how, kind=kind: _train(kind, how, r, n))
                 for kind in ("Adam", "SGD") for how in ("ddp", "rt")]
        return [*cases, ("hvd-SGD", lambda: _train("SGD", "hvd", r, n)),
                ("broadcasts", lambda: _broadcasts(r))]

    return hvd_scenarios(scenarios)


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, init=False, timeout=80)


@pytest.mark.parametrize("case", ["rt-Adam", "rt-SGD", "hvd-SGD"])
def test_a_fused_optimizer_under_grad_scaler_trains_as_ddp(world: list[dict[str, Any]], case: str) -> None:
    kind = case.split("-")[1]
    for rank, (got, want) in enumerate(zip(scenario_results(world, case),
                                           scenario_results(world, f"ddp-{kind}"), strict=True)):
        for a, b in zip(got, want, strict=True):
            assert torch.isfinite(a).all(), (case, rank, a)
            assert torch.allclose(a, b, atol=1e-6), (case, rank, float((a - b).abs().max()))


def test_a_broadcast_of_unlike_shapes_is_refused_and_a_mapping_goes_by_name(
        world: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(scenario_results(world, "broadcasts")):
        assert out["refused"] is not None and out["refused"][0] == "MismatchError", out["refused"]
        assert "rank 1 passes tensor 0 as (3, 2) float32" in out["refused"][1], out["refused"]
        # Refused before anything was overwritten.
        want = torch.arange(6.0).reshape(2, 3) if rank == 0 else torch.zeros(3, 2)
        assert torch.equal(out["kept"], want)
        assert torch.equal(out["ordered"]["a"], torch.full((3,), 1.0)), (rank, out["ordered"])
        assert torch.equal(out["ordered"]["b"], torch.full((3,), 2.0)), (rank, out["ordered"])
