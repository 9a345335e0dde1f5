"""rt.LocalSGD / rt.DiLoCo when ranks step unevenly, and LocalSGD against torch's own
post-local SGD (2 Gloo ranks, one shared world).

Every sync compares the ranks' step counts. Without it, a rank that took more steps
than the others (uneven batches per rank) or called ``sync()`` alone (an evaluation on
rank 0 only) paired its exchange with another round of the others: the final ``sync()``
silently averaged models of different step counts, or a later sync stalled. With it,
every rank of that exchange raises the same MismatchError and the parameters stay as
they were.

The anchor for LocalSGD is torch's post-local SGD: the local step, then
``PeriodicModelAverager(period=H, warmup_steps=H - 1).average_parameters(groups)``, which
is all ``torch.distributed.optim.PostLocalSGDOptimizer.step`` does (that module is not
imported: it costs seconds). torch's averager counts steps from 0 and averages at step
``warmup_steps``, then every ``period``: with that warm-up it averages after the same
steps H, 2H, ... as ``sync_every=H``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_scenarios, run_world, scenario_results
from trainhelp import rank_batch, small_regressor

H = 3


_model = small_regressor
_batch = rank_batch


def _train(m: torch.nn.Module, opt: Any, steps: int, rank: int) -> list[list[torch.Tensor]]:
    after = []
    for s in range(steps):
        x, y = _batch(s, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        after.append([p.detach().clone() for p in m.parameters()])
    return after


def _make(mode: str, m: torch.nn.Module) -> Any:
    import ringtrain as rt

    inner = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    if mode == "LocalSGD":
        return rt.LocalSGD(m, inner, sync_every=H, stall_timeout=10)
    outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return rt.DiLoCo(m, inner, outer, sync_every=H, stall_timeout=10)


def _uneven_final_sync(mode: str) -> dict[str, Any]:
    """Rank 1 takes two steps more than rank 0, then both call sync() (the scheduled
    syncs at 3 and 6 still pair)."""
    import ringtrain as rt

    m = _model()
    opt = _make(mode, m)
    _train(m, opt, 6 + 2 * rt.rank(), rt.rank())
    before = [p.detach().clone() for p in m.parameters()]
    error = ""
    try:
        opt.sync()
    except rt.errors.MismatchError as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
    rt.barrier()
    return {"error": error, "unchanged": unchanged, "after": "in step"}


def _sync_on_rank_0_only() -> dict[str, Any]:
    """rank 0 calls sync() after its 4th step (an evaluation on rank 0 only); its
    exchange pairs with rank 1's scheduled sync after step 6."""
    import ringtrain as rt

    m = _model()
    opt = _make("LocalSGD", m)
    error = ""
    try:
        for s in range(H + 3):
            x, y = _batch(s, rt.rank())
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            if s == H and rt.rank() == 0:
                opt.sync()
    except rt.errors.MismatchError as exc:
        error = str(exc)
    rt.barrier()
    return {"error": error, "after": "in step"}


def _even(mode: str) -> dict[str, Any]:
    """Even steps: the check lets every sync through, ranks equal after the final one."""
    import ringtrain as rt

    m = _model()
    opt = _make(mode, m)
    _train(m, opt, 2 * H + 1, rt.rank())
    opt.sync()
    return {"params": [p.detach().clone() for p in m.parameters()], "syncs": opt.syncs}


def _against_torch(inner: str) -> dict[str, Any]:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    import ringtrain as rt

    def make_inner(params: Any) -> torch.optim.Optimizer:
        if inner == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-2)

    r = rt.rank()
    m = _model()
    local = make_inner(m.parameters())
    averager = PeriodicModelAverager(period=H, warmup_steps=H - 1)

    class PostLocalSGD:  # torch.distributed.optim.PostLocalSGDOptimizer's step, written out
        def zero_grad(self) -> None:
            local.zero_grad()

        def step(self) -> None:
            local.step()
            averager.average_parameters(params=local.param_groups)

    ref = _train(m, PostLocalSGD(), 3 * H + 1, r)
    m = _model()
    ours = _train(m, rt.LocalSGD(m, make_inner(m.parameters()), sync_every=H), 3 * H + 1, r)
    return {"worst": max(float((a - b).abs().max()) for sa, sb in zip(ours, ref, strict=True)
                         for a, b in zip(sa, sb, strict=True))}


def _world() -> dict[str, Any]:
    return run_scenarios([
        ("torch sgd", lambda: _against_torch("sgd")),
        ("torch adamw", lambda: _against_torch("adamw")),
        ("even LocalSGD", lambda: _even("LocalSGD")),
        ("even DiLoCo", lambda: _even("DiLoCo")),
        ("uneven LocalSGD", lambda: _uneven_final_sync("LocalSGD")),
        ("uneven DiLoCo", lambda: _uneven_final_sync("DiLoCo")),
        ("rank 0 sync", _sync_on_rank_0_only),
    ])


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inner", ["sgd", "adamw"])
def test_localsgd_equals_torchs_post_local_sgd_optimizer(world: list[dict[str, Any]], inner: str) -> None:
    for out in scenario_results(world, f"torch {inner}"):
        assert out["worst"] < 1e-6, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["LocalSGD", "DiLoCo"])
def test_even_steps_sync_and_leave_one_model(world: list[dict[str, Any]], mode: str) -> None:
    outs = scenario_results(world, f"even {mode}")
    assert outs[0]["syncs"] == 3, outs[0]["syncs"]  # at 3, 6 and the final sync()
    for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["LocalSGD", "DiLoCo"])
def test_a_final_sync_after_uneven_steps_is_one_error_on_every_rank(world: list[dict[str, Any]],
                                                                    mode: str) -> None:
    for out in scenario_results(world, f"uneven {mode}", after="in step"):
        assert f"rt.{mode}: the ranks reached this sync after different numbers of steps (from 6 to 8" \
            in out["error"], out
        assert out["unchanged"], "the parameters changed although the sync was refused"


@pytest.mark.timeout(120)
def test_sync_called_on_one_rank_only_is_one_error_at_the_next_sync(world: list[dict[str, Any]]) -> None:
    for out in scenario_results(world, "rank 0 sync", after="in step"):
        assert "different numbers of steps (from 4 to 6" in out["error"], out
