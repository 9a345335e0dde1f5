"""rt.LocalSGD / rt.DiLoCo wherever a script hands an optimizer: learning-rate schedulers,
GradScaler, checkpoints, ``param_groups`` writes, ``add_param_group``, and the warm-up of
per-step exchange (2 Gloo ranks, one shared world).

The anchor is torch's own post-local SGD: ``PostLocalSGDOptimizer`` (the real class, its
file loaded alone: ``torch.distributed.optim``'s package import costs seconds) over
``PeriodicModelAverager(period=H, warmup_steps=W + H - 1)``, which averages after the
same steps W + H, W + 2H, ... as ``rt.LocalSGD(sync_every=H, warmup_steps=W)``; for the
warm-up, DDP with ``post_localSGD_hook`` and ``PostLocalSGDState(start_localSGD_iter=W,
post_local_gradient_allreduce=False)`` (gradients averaged for the first W steps, none
after). Every scenario runs both side by side on each rank with the same batches.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ringtest import run_scenarios, run_world, scenario_results
from trainhelp import rank_batch, small_regressor

H = 3
STEPS = 10


_model = small_regressor
_batch = rank_batch


def _post_local_sgd(inner: torch.optim.Optimizer, warmup: int = 0) -> torch.optim.Optimizer:
    """torch's PostLocalSGDOptimizer, averaging after the steps warmup + H, + 2H, ..."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    path = torch.__file__.replace("__init__.py", "distributed/optim/post_localSGD_optimizer.py")
    spec = importlib.util.spec_from_file_location("_torch_post_local_sgd", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    opt: torch.optim.Optimizer = module.PostLocalSGDOptimizer(
        inner, PeriodicModelAverager(period=H, warmup_steps=warmup + H - 1))
    return opt


Sched = Callable[[torch.optim.Optimizer], Any]
SCHEDULERS: dict[str, Sched] = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.3, total_steps=STEPS),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)], milestones=[3]),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
}


def _run(m: torch.nn.Module, opt: Any, sched: Any, steps: range, rank: int,
         scaler: torch.amp.GradScaler | None = None) -> list[tuple[float, list[torch.Tensor]]]:
    out = []
    for s in steps:
        x, y = _batch(s, rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(float(s % 2))  # not improving every other step
        elif sched is not None:
            sched.step()
        out.append((opt.param_groups[0]["lr"], [p.detach().clone() for p in m.parameters()]))
    return out


def _worst(a: list[tuple[float, list[torch.Tensor]]], b: list[tuple[float, list[torch.Tensor]]]) -> float:
    """The largest difference of a parameter or a learning rate over every step."""
    return max(max(abs(la - lb), *(float((x - y).abs().max()) for x, y in zip(pa, pb, strict=True)))
               for (la, pa), (lb, pb) in zip(a, b, strict=True))


def _sgd(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _scheduled(name: str, scaled: bool) -> dict[str, Any]:
    """A scheduler built on the wrapper (and a GradScaler stepping it): the same learning
    rates and parameters as torch's PostLocalSGDOptimizer under the same scheduler."""
    import ringtrain as rt

    r = rt.rank()
    m = _model()
    ref_opt = _post_local_sgd(_sgd(m))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    # torch's wrapper has no `defaults`, which OneCycleLR reads (AttributeError): there
    # the reference schedules its inner optimizer, the same param_groups.
    ref = _run(m, ref_opt, SCHEDULERS[name](ref_opt.optim if name == "OneCycleLR" else ref_opt),  # type: ignore[attr-defined]
               range(STEPS), r, scaler)
    m = _model()
    opt = rt.LocalSGD(m, _sgd(m), sync_every=H)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaled else None
    ours = _run(m, opt, SCHEDULERS[name](opt), range(STEPS), r, scaler)
    return {"worst": _worst(ours, ref), "inner_lr": opt.inner.param_groups[0]["lr"], "lr": ours[-1][0]}


def _diloco_schedule() -> dict[str, Any]:
    """A scheduler on rt.DiLoCo schedules the inner optimizer; the outer keeps its rate."""
    import ringtrain as rt

    m = _model()
    inner = _sgd(m)
    outer = torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = rt.DiLoCo(m, inner, outer, sync_every=H)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _run(m, opt, sched, range(4), rt.rank())
    return {"inner": inner.param_groups[0]["lr"], "outer": outer.param_groups[0]["lr"],
            "params": [p.detach().clone() for p in m.parameters()]}


def _resume(mode: str) -> dict[str, Any]:
    """Each rank saves opt/scheduler/model state_dicts mid-interval (step 5 of H=3),
    loads them into fresh objects (the scheduler built first, as scripts do) and goes on:
    the same learning rates and parameters as the run that never stopped."""
    import ringtrain as rt

    r = rt.rank()

    def build() -> tuple[torch.nn.Module, Any, Any]:
        m = _model()
        inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
        if mode == "LocalSGD":
            opt: Any = rt.LocalSGD(m, inner, sync_every=H)
        else:
            opt = rt.DiLoCo(m, inner, torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True),
                            sync_every=H)
        return m, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)

    m, opt, sched = build()
    straight = _run(m, opt, sched, range(STEPS), r)
    m, opt, sched = build()
    _run(m, opt, sched, range(5), r)
    saved = copy.deepcopy({"model": m.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    del opt  # the new one holds the parameters
    m, opt, sched = build()
    m.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    resumed = _run(m, opt, sched, range(5, STEPS), r)
    # After load_state_dict the inner optimizer's group list is a new one: a write
    # through the wrapper must still reach it.
    opt.param_groups[0]["lr"] = 0.125
    return {"worst": _worst(resumed, straight[5:]), "written": opt.inner.param_groups[0]["lr"]}


def _warmup(closure: bool) -> dict[str, Any]:
    """LocalSGD with warmup_steps=4 against DDP + post_localSGD_hook (start_localSGD_iter=4)
    + PostLocalSGDOptimizer: the same parameters after every step; ranks equal after the
    warm-up, apart between syncs."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )

    import ringtrain as rt

    r, w = rt.rank(), 4
    m = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    ddp.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=w,
                                             post_local_gradient_allreduce=False), post_localSGD_hook)
    ref_opt = _post_local_sgd(torch.optim.AdamW(m.parameters(), lr=1e-2), warmup=w)
    ref = []
    for s in range(STEPS):
        x, y = _batch(s, r)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        ref_opt.step()
        ref.append((0.0, [p.detach().clone() for p in m.parameters()]))
    m = _model()
    opt = rt.LocalSGD(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sync_every=H, warmup_steps=w)
    ours = []
    for s in range(STEPS):
        x, y = _batch(s, r)

        def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        if closure:
            opt.step(loss_of)
        else:
            loss_of()
            opt.step()
        ours.append((0.0, [p.detach().clone() for p in m.parameters()]))
    return {"worst": _worst(ours, ref), "after": [p for _, p in ours]}


class _Branches(torch.nn.Module):
    """small_regressor plus a head only rank 0 uses and one no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()
        self.rank0 = torch.nn.Linear(6, 1)
        self.idle = torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out + self.rank0(x) if rank == 0 else out


def _warmup_unused() -> dict[str, Any]:
    """The warm-up with parameters no rank uses (and one only rank 0 uses), under AdamW,
    against DDP(find_unused_parameters=True) + post_localSGD_hook: the idle head keeps no
    gradient and does not move (a zero gradient would still decay it); rank 1 gets the
    average of rank 0's head gradient, as DDP's."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )

    import ringtrain as rt

    r, w, steps = rt.rank(), 3, 5

    def run(m: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], opt: Any) -> list[Any]:
        out = []
        for s in range(steps):
            x, y = _batch(s, r)
            opt.zero_grad()
            torch.nn.functional.mse_loss(forward(x), y).backward()
            opt.step()
            out.append((0.0, [p.detach().clone() for p in m.parameters()]))
        return out

    m = _Branches()
    ddp = torch.nn.parallel.DistributedDataParallel(m, find_unused_parameters=True)
    ddp.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=w,
                                             post_local_gradient_allreduce=False), post_localSGD_hook)
    ref = run(m, lambda x: ddp(x, r), _post_local_sgd(torch.optim.AdamW(m.parameters(), lr=1e-2), warmup=w))
    m = _Branches()
    idle = m.idle.weight.detach().clone()
    opt = rt.LocalSGD(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sync_every=H, warmup_steps=w)
    ours = run(m, lambda x: m(x, r), opt)
    # Compared through the warm-up: after it DDP still fills rank 1's gradient of the
    # head it did not use with its own zeros (the used map is exchanged every step), a
    # local step rt.LocalSGD leaves to the local optimizer (None: AdamW skips it).
    return {"worst": _worst(ours[:w], ref[:w]), "idle_moved": not torch.equal(m.idle.weight, idle),
            "idle_grad": m.idle.weight.grad is None, "bytes": opt.exchanged_bytes}


def _hooks() -> dict[str, Any]:
    """torch.optim.Optimizer's hooks on the wrapper: the instance ones registered on it run
    around its step() and state_dict() with it as the optimizer; the global ones run once
    per step (the local optimizer's), warm-up steps included."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import ringtrain as rt

    m = _model()
    opt = rt.DiLoCo(m, torch.optim.AdamW(m.parameters(), lr=1e-2),
                    torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9), sync_every=H, warmup_steps=2)
    seen: list[Any] = []
    global_steps = [0]
    handles = [
        register_optimizer_step_post_hook(lambda o, a, k: global_steps.__setitem__(0, global_steps[0] + 1)),
        opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", o is opt, opt.steps))),
        opt.register_step_post_hook(lambda o, a, k: seen.append(("post", o is opt, opt.steps))),
        opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": o is opt}),
        opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "tag"}),
        opt.register_load_state_dict_post_hook(lambda o: seen.append(("loaded", o is opt, opt.steps))),
    ]
    # 4 steps: 2 of warm-up, 2 local (DiLoCo's outer optimizer is stepped at syncs only).
    _run(m, opt, None, range(4), rt.rank())
    state = opt.state_dict()
    opt.load_state_dict(state)
    for handle in handles:
        handle.remove()
    _run(m, opt, None, range(4, 5), rt.rank())
    return {"seen": seen, "global": global_steps[0], "tag": state.get("tag"), "outer": "outer" in state}


def _join_rates() -> dict[str, Any]:
    """A rank that joins after a resize (fresh model, optimizer and scheduler) with a
    StepLR on the wrapper: after the world change (Resumable.sync, as rt.elastic calls it,
    loading rank 0's scheduler state) it steps with the same learning rate as the others,
    as Horovod's TorchState.sync gives it rank 0's optimizer groups."""
    import tempfile

    import ringtrain as rt

    r = rt.rank()
    out = {}
    for mode in ("LocalSGD", "DiLoCo"):
        def build(mode: str = mode) -> tuple[torch.nn.Module, Any, Any]:
            m = _model()
            if mode == "LocalSGD":
                opt: Any = rt.LocalSGD(m, _sgd(m), sync_every=H)
            else:
                opt = rt.DiLoCo(m, _sgd(m), torch.optim.SGD(m.parameters(), lr=0.7), sync_every=H)
            return m, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

        m, opt, sched = build()
        _run(m, opt, sched, range(4), r)
        if r == 1:  # the joining rank
            del opt
            m, opt, sched = build()
        with tempfile.TemporaryDirectory() as directory:
            rt.elastic.Resumable(directory, model=m, optimizer=opt, scheduler=sched).sync()
        out[mode] = [lr for lr, _ in _run(m, opt, sched, range(4, 6), r)]
    return out


def _param_groups() -> dict[str, Any]:
    """add_param_group: a part of the model the inner optimizer did not hold is added
    (as PostLocalSGDOptimizer); a tensor outside the model is refused, also when added to
    the inner optimizer directly (at the next step)."""
    import ringtrain as rt

    m = _model()
    opt = rt.LocalSGD(m, torch.optim.SGD(m[0].parameters(), lr=0.1), sync_every=H)
    opt.add_param_group({"params": m[2].parameters(), "lr": 0.05})
    _run(m, opt, None, range(H), rt.rank())
    errors = []
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    except rt.errors.OptimizerUsageError as exc:
        errors.append(str(exc))
    opt.inner.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    try:
        _run(m, opt, None, range(1), rt.rank())
    except rt.errors.OptimizerUsageError as exc:
        errors.append(str(exc))
    return {"groups": len(opt.inner.param_groups), "errors": errors,
            "params": [p.detach().clone() for p in m.parameters()]}


def _world() -> dict[str, Any]:
    return run_scenarios([
        *((f"sched {name}", lambda name=name: _scheduled(name, False)) for name in SCHEDULERS),
        ("sched scaled", lambda: _scheduled("StepLR", True)),
        ("diloco sched", _diloco_schedule),
        ("resume LocalSGD", lambda: _resume("LocalSGD")),
        ("resume DiLoCo", lambda: _resume("DiLoCo")),
        ("warmup", lambda: _warmup(False)),
        ("warmup closure", lambda: _warmup(True)),
        ("warmup unused", _warmup_unused),
        ("hooks", _hooks),
        ("join rates", _join_rates),
        ("groups", _param_groups),
    ])


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", [*SCHEDULERS, "scaled"])
def test_a_scheduler_on_localsgd_equals_it_on_torchs_post_local_sgd(world: list[dict[str, Any]],
                                                                    name: str) -> None:
    for out in scenario_results(world, f"sched {name}"):
        assert out["worst"] < 1e-6, out
        assert out["inner_lr"] == out["lr"], out  # the wrapper's groups are the inner's


@pytest.mark.timeout(150)
def test_a_scheduler_on_diloco_schedules_the_inner_optimizer(world: list[dict[str, Any]]) -> None:
    outs = scenario_results(world, "diloco sched")
    for out in outs:
        assert out["inner"] == pytest.approx(0.1 / 16) and out["outer"] == 0.7, out
    for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True):
        assert not torch.equal(a, b)  # step 4 is between syncs: each rank's own


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["LocalSGD", "DiLoCo"])
def test_a_mid_interval_resume_with_a_scheduler_is_bit_exact(world: list[dict[str, Any]], mode: str) -> None:
    for out in scenario_results(world, f"resume {mode}"):
        assert out["worst"] == 0.0, out
        assert out["written"] == 0.125, out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("label", ["warmup", "warmup closure"])
def test_warmup_steps_equals_torchs_post_local_sgd_warmup(world: list[dict[str, Any]], label: str) -> None:
    outs = scenario_results(world, label)
    for out in outs:
        assert out["worst"] < 1e-6, out["worst"]
    a, b = outs[0]["after"], outs[1]["after"]
    same = [all(torch.equal(x, y) for x, y in zip(a[s], b[s], strict=True)) for s in range(STEPS)]
    # 1-based: equal through the warm-up (4) and after the syncs at 7 and 10; apart at 5, 6, 8, 9.
    assert same == [True] * 4 + [False, False, True, False, False, True], same


@pytest.mark.timeout(150)
def test_warmup_leaves_a_parameter_no_rank_used_alone_as_ddp(world: list[dict[str, Any]]) -> None:
    for out in scenario_results(world, "warmup unused"):
        assert out["worst"] < 1e-6, out
        assert not out["idle_moved"] and out["idle_grad"], out
        assert out["bytes"] > 0, out  # the warm-up's exchanges are counted (and metered)


@pytest.mark.timeout(150)
def test_optimizer_hooks_on_the_wrapper_run_as_torchs(world: list[dict[str, Any]]) -> None:
    for out in scenario_results(world, "hooks"):
        steps = [(kind, me, n) for kind, me, n in out["seen"] if kind != "loaded"]
        assert steps == [(k, True, n + (k == "post")) for n in range(4) for k in ("pre", "post")], out
        assert out["seen"][-1] == ("loaded", True, 4), out
        assert out["global"] == 4, out
        assert out["tag"] is True and out["outer"], out


@pytest.mark.timeout(150)
def test_a_joining_rank_takes_rank_0s_learning_rates(world: list[dict[str, Any]]) -> None:
    outs = scenario_results(world, "join rates")
    for mode in ("LocalSGD", "DiLoCo"):
        assert outs[1][mode] == outs[0][mode] == pytest.approx([0.1 / 32, 0.1 / 64]), (mode, outs)


@pytest.mark.timeout(150)
def test_add_param_group_takes_model_parameters_and_refuses_strangers(world: list[dict[str, Any]]) -> None:
    outs = scenario_results(world, "groups")
    for out in outs:
        assert out["groups"] == 3, out
        assert len(out["errors"]) == 2, out
        assert all("not one of the model's parameters" in e for e in out["errors"]), out
    for a, b in zip(outs[0]["params"], outs[1]["params"], strict=True):
        assert torch.equal(a, b)  # the added group was synced at step H
