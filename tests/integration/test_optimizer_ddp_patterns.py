"""A DDP training loop's habits with rt.DistributedOptimizer (issue: an audit against DDP).

Under DDP ``loss.backward()`` returns with the gradients averaged, so scripts clip,
unscale (GradScaler), log a global metric or skip an update between ``backward()`` and
``step()``. With the default ``sync_at="backward"`` the same loop must train as DDP's
(every rank identical, equal to one process on the global batch): before, clipping
read buckets still in flight (replicas 9.0 apart after 20 steps), a skipped update
raised at the next backward, and a collective there could pair with a bucket that one
rank started later (Gloo aborted the job). ``sync_at="step"`` keeps Horovod's contract
(``synchronize()`` first), and its skipped-update recipe works too.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from ringtest import run_world
from trainhelp import seeded_batch as _batch
from trainhelp import tiny_model as _model

ROWS = 6  # per rank per step
STEPS = 6
SKIP = 2  # the step whose loss is inf on every rank (an overflow): no update


def _reference(n: int) -> list[torch.Tensor]:
    """One process, the global batch: clip to 0.5, skip step SKIP."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, n * ROWS)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss * (math.inf if step == SKIP else 1.0)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if math.isfinite(norm):
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(sync_at: str, strategy: str) -> dict[str, Any]:
    import ringtrain as rt

    r, n = rt.rank(), rt.size()
    model = _model()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), strategy=strategy,
                                  fusion_mb=0.0001, sync_at=sync_at)
    logged = []
    for step in range(STEPS):
        x, y = _batch(step, n * ROWS)
        rows = slice(r * ROWS, (r + 1) * ROWS)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        (loss * (math.inf if step == SKIP else 1.0)).backward()
        if sync_at == "step":
            opt.synchronize()  # Horovod's recipe
        # A DDP habit: a collective between backward() and step() (the global loss).
        logged.append(float(rt.allreduce(loss.detach().reshape(1))))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if not math.isfinite(norm):
            continue  # skipped: the next zero_grad() drops this step
        if sync_at == "step":
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "logged": logged}


def _all_modes() -> dict[str, Any]:
    return {f"{sync_at}/{strategy}": _train(sync_at, strategy)
            for sync_at, strategy in (("backward", "native"), ("backward", "ring"),
                                      ("backward", "ps"), ("step", "native"))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_clip_log_and_skip_between_backward_and_step_train_as_one_process(n: int) -> None:
    results = run_world(_all_modes, n, timeout=110)
    want = _reference(n)
    for mode in results[0]:
        for rank, per_rank in enumerate(results):
            got = per_rank[mode]["params"]
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6,
                                           msg=lambda m, k=mode, r=rank: f"{k} rank {r}: {m}")
            assert per_rank[mode]["logged"] == results[0][mode]["logged"]


def _unused_on_one_rank() -> list[torch.Tensor]:
    import ringtrain as rt

    torch.manual_seed(0)
    trunk, head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    params = [*trunk.parameters(), *head.parameters()]
    named = [*(("trunk." + k, v) for k, v in trunk.named_parameters()),
             *(("head." + k, v) for k, v in head.named_parameters())]
    opt = rt.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=named,
                                  fusion_mb=0.00001)
    for step in range(4):
        opt.zero_grad()
        out = trunk(torch.full((2, 3), float(step + rt.rank())))
        # rank 1 never uses the head: its bucket starts only once backward has ended
        loss = (head(out) if rt.rank() == 0 else out).sum()
        loss.backward()
        rt.allreduce(loss.detach().reshape(1), name="loss")
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.timeout(60)
def test_a_collective_after_backward_with_a_parameter_one_rank_did_not_use() -> None:
    # Gloo aborted this job ("Received data size doesn't match expected size"): rank 1
    # started the head's bucket in step(), after the loss's allreduce.
    first, second = run_world(_unused_on_one_rank, 2, timeout=50)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def _mistakes() -> list[str]:
    import ringtrain as rt

    out = []
    for sync_at, passes in (("backward", 2), ("step", 1)):
        model = torch.nn.Linear(3, 1)
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      backward_passes_per_step=passes, sync_at=sync_at)
        model(torch.ones(2, 3)).sum().backward()  # one pass: accumulating, or in flight
        try:
            opt.zero_grad()
            out.append("")
        except AssertionError as exc:  # what Horovod raises; also a ConfigError
            out.append(type(exc).__name__ + ": " + str(exc))
        for _ in range(passes - 1):
            model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()  # after step(): fine
    model = torch.nn.Linear(3, 1)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), sync_at="step")
    model(torch.ones(2, 3)).sum().backward()
    opt.synchronize()
    try:  # Horovod's contract: a pass after the step's exchange, before step()
        model(torch.ones(2, 3)).sum().backward()
        out.append("")
    except rt.errors.ConfigError as exc:
        out.append(str(exc))
    try:
        rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync_at="later")
    except rt.errors.ConfigError as exc:
        out.append(str(exc))
    return out


@pytest.mark.timeout(60)
def test_zero_grad_mid_step_a_pass_too_many_and_a_bad_sync_at_are_named() -> None:
    accumulating, in_flight, extra_pass, bad = run_world(_mistakes, 1, timeout=50)[0]
    assert accumulating.startswith("OptimizerUsageError: ")
    assert "zero_grad() was called after backward() and before step()" in accumulating
    assert "zero_grad() was called after backward() and before step()" in in_flight
    assert "call synchronize() first" in in_flight
    assert "zero_grad() to drop the step" in extra_pass
    assert "backward_passes_per_step" in extra_pass
    assert "sync_at must be 'backward'" in bad and "'later'" in bad


def _rewrap() -> dict[str, Any]:
    import ringtrain as rt

    def wrap(model: torch.nn.Module, lr: float) -> Any:
        return rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                       named_parameters=model.named_parameters())

    def train(model: torch.nn.Module, opt: Any, steps: int) -> None:
        for step in range(steps):
            opt.zero_grad()
            model(torch.full((2, 3), float(step + rt.rank()))).sum().backward()
            opt.step()

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = wrap(model, 0.1)
    train(model, opt, 2)
    opt = wrap(model, 0.05)  # a new phase: the first wrapper is gone
    train(model, opt, 2)
    kept = opt
    scheduler = torch.optim.lr_scheduler.StepLR(kept, step_size=1)  # keeps it alive
    opt = wrap(model, 0.02)  # ... and is replaced while alive
    train(model, opt, 2)
    try:
        kept.step()
        stale = ""
    except rt.errors.ConfigError as exc:
        stale = str(exc)
    del scheduler
    return {"params": [p.detach().clone() for p in model.parameters()], "stale": stale}


def _rewrap_reference(n: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    for lr in (0.1, 0.05, 0.02):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(2):
            _global_step(model, opt, step, n)
    return [p.detach().clone() for p in model.parameters()]


def _global_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, n: int) -> None:
    """One process, the ranks' batches of ``step`` together (each rank's is
    ``full((2, 3), step + rank)``, loss summed): the update the ranks' average makes."""
    opt.zero_grad()
    x = torch.cat([torch.full((2, 3), float(step + r)) for r in range(n)])
    (model(x).sum() / n).backward()
    opt.step()


@pytest.mark.timeout(60)
def test_an_optimizer_built_again_for_the_same_model_takes_over() -> None:
    # The first wrapper's hooks outlived it and counted passes for the new one:
    # "got 2 backward passes ... raise backward_passes_per_step" at the second step.
    results = run_world(_rewrap, 2, timeout=50)
    for out in results:
        for got, want in zip(out["params"], _rewrap_reference(2), strict=True):
            torch.testing.assert_close(got, want)
        assert "this DistributedOptimizer was replaced" in out["stale"]


def _frozen_after_wrapping(sync_at: str) -> list[torch.Tensor]:
    import ringtrain as rt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
        named_parameters=model.named_parameters(), sync_at=sync_at)
    for step in range(3):
        if step == 1:
            model[0].requires_grad_(False)  # fine-tuning the head from here on
        opt.zero_grad()
        model(torch.full((2, 3), float(step + rt.rank()))).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _frozen_reference(n: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for step in range(3):
        if step == 1:
            model[0].requires_grad_(False)
        _global_step(model, opt, step, n)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)
def test_a_parameter_frozen_after_wrapping_stays_put_as_under_ddp() -> None:
    # It got a zero gradient, so momentum and weight decay moved it (0.88 here before).
    for out in run_world(_frozen_after_wrapping, 2, "backward", timeout=50):
        for got, want in zip(out, _frozen_reference(2), strict=True):
            torch.testing.assert_close(got, want)


def _grads_by_hand(sync_at: str) -> list[float]:
    import ringtrain as rt

    w = torch.nn.Parameter(torch.zeros(2))
    opt = rt.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                  sync_at=sync_at)
    (g,) = torch.autograd.grad((w * float(rt.rank() + 1)).sum(), [w])  # no .grad, no hook
    w.grad = g
    opt.step()
    first = w.detach().clone()
    opt.step()  # no backward in between: the same gradient again
    return [*first.tolist(), *w.detach().tolist()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sync_at", ["backward", "step"])
def test_gradients_set_by_hand_are_averaged_as_horovod_does(sync_at: str) -> None:
    # They were replaced by zeros (a parameter no backward reached "contributed zeros"),
    # so the step did nothing.
    for out in run_world(_grads_by_hand, 2, sync_at, timeout=50):
        assert out == [-1.5, -1.5, -3.0, -3.0]


def _closure_training(sync_at: str, zero_grad_on: str) -> list[float]:
    """SGD then LBFGS stepped with a closure (zero_grad, forward, backward inside it),
    against one process on the global batch; returns the two largest differences."""
    import ringtrain as rt

    rank, size = rt.rank(), rt.size()

    def batch(r: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * s + r)
        return torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g)

    def train(kind: str, dist: bool) -> torch.Tensor:
        model = _model()
        inner: torch.optim.Optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                                        if kind == "sgd" else
                                        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5))
        opt: Any = (rt.DistributedOptimizer(inner, named_parameters=model.named_parameters(), sync_at=sync_at)
                    if dist else inner)
        for s in range(3):
            def closure(s: int = s) -> torch.Tensor:
                (opt if zero_grad_on == "optimizer" else model).zero_grad()
                ranks = [rank] if dist else range(size)
                loss = sum(torch.nn.functional.mse_loss(model(batch(r, s)[0]), batch(r, s)[1]) for r in ranks)
                loss = loss / (1 if dist else size)
                loss.backward()
                return loss
            with torch.no_grad():
                own = float(torch.nn.functional.mse_loss(model(batch(rank, s)[0]), batch(rank, s)[1]))
            returned = opt.step(closure)
            if dist:  # this rank's own loss of the first call, as DDP's step(closure) returns
                losses.append(abs(float(returned) - own))
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    losses: list[float] = []
    out = [float((train(kind, True) - train(kind, False)).abs().max()) for kind in ("sgd", "lbfgs")]
    return out + [max(losses)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sync_at", "zero_grad_on"), [("backward", "model"), ("step", "optimizer")])
def test_a_closure_step_trains_as_one_process_on_the_global_batch(sync_at: str, zero_grad_on: str) -> None:
    # Before, under sync_at="step" (hvd's) the optimizer read gradients still in flight
    # (ranks 7e-2 apart after one SGD step, then a duplicate-name error), and a closure
    # calling model.zero_grad() raised; LBFGS decides on the loss, so ranks must also
    # see the same (averaged) loss or they stop at different calls.
    for out in run_world(_closure_training, 2, sync_at, zero_grad_on, timeout=80):
        assert out[0] < 1e-6 and out[1] < 1e-5, out
        assert out[2] < 1e-6  # step() returns the rank's own loss, not the ranks' average


def _checkpointed(where: str) -> list[float]:
    """Reentrant activation checkpointing around the last layer or the whole model,
    clipping between backward() and step() (so .grad must be combined when backward
    returns); the largest difference from one process on the global batch, and between
    the ranks."""
    from torch.utils.checkpoint import checkpoint

    import ringtrain as rt

    rank, size = rt.rank(), rt.size()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model()
            self.head = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if where == "whole":
                return checkpoint(lambda t: self.head(self.body(t)), x, use_reentrant=True)
            return checkpoint(self.head, self.body(x), use_reentrant=True)

    def train(dist: bool) -> torch.Tensor:
        torch.manual_seed(3)
        model = Net()
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if dist:
            opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        for s in range(3):
            opt.zero_grad()
            ranks = [rank] if dist else range(size)
            loss = 0.0
            for r in ranks:
                g = torch.Generator().manual_seed(100 * s + r)
                x = torch.randn(ROWS, 4, generator=g).requires_grad_(True)
                loss = loss + torch.nn.functional.mse_loss(model(x), torch.randn(ROWS, 2, generator=g))
            (loss / (1 if dist else size)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    mine = train(True)
    both = rt.allgather(mine.reshape(1, -1))
    return [float((mine - train(False)).abs().max()), float((both[0] - both[1]).abs().max())]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["last", "whole"])
def test_reentrant_checkpointing_trains_as_one_process(where: str) -> None:
    # Before, when the checkpointed part's gradients came first, the end-of-backward
    # callback ran at the end of the checkpoint's own backward and the outer backward's
    # next gradient raised OptimizerUsageError.
    for out in run_world(_checkpointed, 2, where, timeout=50):
        assert out[0] < 1e-6 and out[1] == 0.0, out


def _unfrozen_after_wrapping(sync_at: str, named: bool) -> dict[str, Any]:
    """The backbone frozen when the optimizer is wrapped, unfrozen at step 2 (train the
    head first, then everything): parameters after 5 steps, and what was warned."""
    import warnings

    import ringtrain as rt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    model[0].requires_grad_(False)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters() if named else None, sync_at=sync_at)
    caught: list[str] = []
    for step in range(5):
        if step == 2:
            model[0].requires_grad_(True)
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            model(torch.full((2, 3), float(step + rt.rank()))).sum().backward()
            opt.step()
        caught += [str(w.message) for w in got]
    return {"params": [p.detach().clone() for p in model.parameters()], "warned": caught,
            "buckets": opt.bucket_names}


def _unfrozen_reference(n: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        if step == 2:
            model[0].requires_grad_(True)
        _global_step(model, opt, step, n)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sync_at", "named"), [("backward", True), ("step", False)])
def test_a_parameter_unfrozen_after_wrapping_is_averaged_from_then_on(sync_at: str, named: bool) -> None:
    # It was stepped on each rank's own gradient (as Horovod and DDP do): the backbone's
    # replicas drifted apart, 0.1 after three steps here, with no error.
    want = _unfrozen_reference(2)
    for out in run_world(_unfrozen_after_wrapping, 2, sync_at, named, timeout=50):
        for got, ref in zip(out["params"], want, strict=True):
            torch.testing.assert_close(got, ref)
        assert len(out["warned"]) == 1, out["warned"]
        assert "2 parameter(s) frozen when the DistributedOptimizer was wrapped" in out["warned"][0]
        assert ("0.weight" if named else "frozen0") in out["warned"][0]
        assert any(("0.bias" if named else "frozen1") in b for b in out["buckets"]), out["buckets"]


def _kept_gradients(strategy: str, horovod: bool) -> dict[str, Any]:
    """Train a few steps; keep step 1's `.grad` tensors (as a script logging gradient
    statistics, or an optimizer storing the last gradient, does) and compare them later
    with clones taken at the time. Counts buffers replaced in normal steps."""
    import ringtrain as rt

    model = _model()
    if horovod:
        import ringtrain.horovod as hvd

        hvd.init()
        opt: Any = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
    else:
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), strategy=strategy)
    kept: list[torch.Tensor] = []
    clones: list[torch.Tensor] = []
    fresh_in_plain_steps = 0
    for step in range(6):
        opt.zero_grad(set_to_none=step % 2 == 0)
        x, y = _batch(step, ROWS)
        torch.nn.functional.mse_loss(model(x + rt.rank()), y).backward()
        before = opt._fusion.fresh_buffers
        opt.step()
        if step != 2:  # the step after the one whose gradients were kept
            fresh_in_plain_steps += opt._fusion.fresh_buffers - before
        if step == 1:  # the next zero_grad sets None (in-place zeroing would change them anywhere)
            kept = [p.grad for p in model.parameters()]
            clones = [g.clone() for g in kept]
    return {"changed": max(float((k - c).abs().max()) for k, c in zip(kept, clones, strict=True)),
            "fresh": fresh_in_plain_steps}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("strategy", "horovod"), [("native", False), ("ring", False), ("ps", False),
                                                    ("native", True)])
def test_a_gradient_kept_from_an_earlier_step_keeps_its_values(strategy: str, horovod: bool) -> None:
    # `.grad` was a view of the bucket buffer, which the next step overwrote: a kept
    # gradient silently became the next step's (DDP and Horovod leave it as it was).
    for out in run_world(_kept_gradients, 2, strategy, horovod, timeout=80):
        assert out["changed"] == 0.0, out
        assert out["fresh"] == 0, out  # no new buffer unless a view is held


def _clip_under_horovod(recipe: bool, compressed: bool) -> dict[str, Any]:
    """hvd: clip right after backward (without synchronize(), against Horovod's contract)
    or with Horovod's recipe; the ranks' largest parameter difference after 8 steps, and
    what was warned."""
    import warnings

    import ringtrain.horovod as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256),
                                torch.nn.Linear(256, 4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16 if compressed else hvd.Compression.none)
    caught: list[str] = []
    for step in range(8):
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * step + hvd.rank())
        model(torch.randn(16, 256, generator=g) * 3).pow(2).mean().backward()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            if recipe:
                opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            if recipe:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        caught += [str(w.message) for w in got]
    flat = torch.cat([p.detach().reshape(1, -1) for p in model.parameters()], 1)
    both = hvd.allgather(flat)
    return {"apart": float((both[0] - both[1]).abs().max()), "warned": caught}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("compressed", [False, True])
def test_clipping_before_synchronize_under_horovod_keeps_replicas_equal_and_says_so(compressed: bool) -> None:
    # The clip scaled the bucket while the ring was summing it: replicas ended 3e-3 to
    # 6e-3 apart after 10 steps, differently from run to run, with no warning.
    for out in run_world(_clip_under_horovod, 2, False, compressed, timeout=80):
        assert out["apart"] == 0.0, out["apart"]
        assert len(out["warned"]) == 8 and "before optimizer.synchronize()" in out["warned"][0], out["warned"]
    for out in run_world(_clip_under_horovod, 2, True, compressed, timeout=80):
        assert out["apart"] == 0.0 and out["warned"] == [], out
