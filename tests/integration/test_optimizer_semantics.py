"""DistributedOptimizer trains exactly as Horovod does (issue: silently wrong training).

- Gradient accumulation sums the local passes; ``op=Average`` divides by the ranks only,
  so N ranks x k passes of batch b with the loss divided by k equal one process with
  batch N*k*b (also for ``op=Sum``, fp16 on the wire, and a step after fewer passes).
- The wrapper *is* the wrapped optimizer's state: after ``broadcast_optimizer_state``,
  ``load_state_dict`` or any LR scheduler, every rank holds bit-identical parameters.
- Sparse gradients (``nn.Embedding(sparse=True)``) match a single-process reference.

Each world runs every configuration in one set of processes (process start-up, not
training, dominates these tests' time).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_world

B = 4  # rows per pass per rank


def _linear(seed: int) -> torch.nn.Module:
    # Dyadic weights and data keep every gradient exactly representable in fp16, so the
    # fp16 configurations test the scaling, not rounding.
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.randint(-4, 5, (2, 4), generator=g).float() / 4)
    return m


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _data(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(-2, 3, (rows, 4), generator=g).float()
    y = torch.randint(-2, 3, (rows, 2), generator=g).float()
    return x, y


#: (model, passes k, op, compression, passes in the last step)
CONFIGS = [
    ("mlp", 1, "Average", "none", 1),
    ("mlp", 2, "Average", "none", 2),
    ("mlp", 4, "Average", "none", 4),
    ("mlp", 2, "Sum", "none", 2),
    ("mlp", 4, "Average", "none", 2),  # step() after fewer than k passes (end of epoch)
    ("linear", 1, "Average", "fp16", 1),
    ("linear", 2, "Average", "fp16", 2),
    ("linear", 4, "Sum", "fp16", 4),
    ("linear", 4, "Average", "fp16", 3),
]
STEPS = 3


def _steps(kind: str) -> int:
    # After one update the weights need more than fp16's 11 significant bits: the fp16
    # configurations take one (exact) step, the others three.
    return 1 if kind == "linear" else STEPS


def _passes_at(step: int, steps: int, k: int, last: int) -> int:
    return last if step == steps - 1 else k


def _reference(n: int, kind: str, k: int, op: str, last: int) -> list[torch.Tensor]:
    """One process, batch N*k*b: the mean loss, times N for Sum, times j/k for a step
    with j < k passes (Horovod sums the j passes of loss/k)."""
    model = (_linear if kind == "linear" else _mlp)(7)  # rank 0's model
    opt = torch.optim.SGD(model.parameters(), lr=0.0625, momentum=0.5)
    steps = _steps(kind)
    for step in range(steps):
        j = _passes_at(step, steps, k, last)
        x, y = _data(step, n * k * B)
        # rank r, pass i uses rows [(r*k + i)*B, (r*k + i + 1)*B): take the j passes of each rank
        rows = torch.cat([torch.arange((r * k + i) * B, (r * k + i + 1) * B)
                          for r in range(n) for i in range(j)])
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows]) * (j / k)
        if op == "Sum":
            loss = loss * n
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train_all() -> list[list[torch.Tensor]]:
    import ringtrain as rt

    out = []
    for kind, k, op, comp, last in CONFIGS:
        model = (_linear if kind == "linear" else _mlp)(rt.rank() + 7)  # broadcast must fix it
        rt.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0625, momentum=0.5),
            named_parameters=model.named_parameters(),
            compression=getattr(rt.Compression, comp), backward_passes_per_step=k,
            op=getattr(rt, op), fusion_mb=0.0001,  # several buckets
        )
        steps = _steps(kind)
        for step in range(steps):
            x, y = _data(step, rt.size() * k * B)
            opt.zero_grad()
            for i in range(_passes_at(step, steps, k, last)):
                rows = slice((rt.rank() * k + i) * B, (rt.rank() * k + i + 1) * B)
                loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / k
                loss.backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_accumulation_sums_passes_and_averages_over_ranks_as_horovod(n: int) -> None:
    results = run_world(_train_all, n, timeout=140)
    for c, config in enumerate(CONFIGS):
        expected = _reference(n, *config[:3], config[4])
        for rank, per_rank in enumerate(results):
            for got, want in zip(per_rank[c], expected, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, c=config, r=rank: f"{c} rank {r}: {m}")
            for got, rank0 in zip(per_rank[c], results[0][c], strict=True):
                assert torch.equal(got, rank0), f"{config}: rank {rank} differs from rank 0"


# -- the wrapper shares the wrapped optimizer's state --------------------------------------

LR_STEPS = 20


def _schedule_factory(kind: str) -> Any:
    lr_sched = torch.optim.lr_scheduler
    return {
        "warmup": None,  # the script sets param_group["lr"] itself, as Horovod's examples do
        "step": lambda o: lr_sched.StepLR(o, step_size=3, gamma=0.5),
        "lambda": lambda o: lr_sched.LambdaLR(o, lambda s: (s + 1) / 5 if s < 5 else 1.0),
        "onecycle": lambda o: lr_sched.OneCycleLR(o, max_lr=0.2, total_steps=LR_STEPS),
        "plateau": lambda o: lr_sched.ReduceLROnPlateau(o, factor=0.5, patience=0),
    }[kind]


def _lr_run(kind: str, path: str, distributed: bool) -> list[torch.Tensor]:
    """Train LR_STEPS steps with a learning rate that changes every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if distributed:
        import ringtrain as rt

        n, r = rt.size(), rt.rank()
        opt: Any = rt.DistributedOptimizer(inner, named_parameters=model.named_parameters())
        assert isinstance(opt, torch.optim.SGD)
        if path == "broadcast":
            rt.broadcast_optimizer_state(opt, root_rank=0)
        elif path == "load":
            opt.load_state_dict(inner.state_dict())  # a resume from a checkpoint
    else:
        n, r, opt = 1, 0, inner
    factory = _schedule_factory(kind)
    sched = factory(opt) if factory else None
    for step in range(LR_STEPS):
        x, y = _data(step, 2 * B)
        if not distributed:
            xs, ys = x, y
        else:
            xs, ys = x[r * (2 * B) // n:(r + 1) * (2 * B) // n], y[r * (2 * B) // n:(r + 1) * (2 * B) // n]
        if kind == "warmup":
            for group in opt.param_groups:
                group["lr"] = 0.1 * min(1.0, (step + 1) / 5)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(1.0)  # a metric that never improves: the LR halves every step
        elif sched is not None:
            sched.step()
    return [p.detach().clone() for p in model.parameters()]


def _lr_all() -> dict[str, list[torch.Tensor]]:
    return {f"{kind}/{path}": _lr_run(kind, path, True)
            for kind in ("warmup", "step", "lambda", "onecycle", "plateau")
            for path in ("broadcast", "load")}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_lr_changes_reach_every_rank_after_broadcast_or_load_state_dict(n: int) -> None:
    # 2*B rows split over 3 ranks is uneven (3/3/2): mean of means != global mean, so the
    # single-process comparison is only made for n=2; identity across ranks for both.
    results = run_world(_lr_all, n, timeout=140)
    for key, params in results[0].items():
        for rank in range(1, n):
            for got, want in zip(results[rank][key], params, strict=True):
                assert torch.equal(got, want), f"{key}: rank {rank} drifted from rank 0"
        if n == 2:
            expected = _lr_run(key.split("/")[0], "none", False)
            for got, want in zip(params, expected, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=key)


# -- sparse gradients -------------------------------------------------------------------------

class _Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(20, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def _ids(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 20, (rows, 3), generator=g), torch.randn(rows, 1, generator=g)


def _sparse_run(distributed: bool, as_dense: bool, n: int = 1, steps: int = 5) -> list[torch.Tensor]:
    model = _Bag()
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    r = 0
    opt: Any = inner
    if distributed:
        import ringtrain as rt

        r = rt.rank()
        opt = rt.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                      sparse_as_dense=as_dense)
    for step in range(steps):
        ids, y = _ids(step, n * B)
        rows = slice(r * B, (r + 1) * B) if distributed else slice(None)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids[rows]), y[rows]).backward()
        if distributed and not as_dense:
            assert model.emb.weight.grad.is_sparse
        opt.step()
        if distributed and not as_dense:
            assert model.emb.weight.grad.is_sparse, "the exchanged gradient stays sparse"
    return [p.detach().clone() for p in model.parameters()]


def _sparse_all() -> dict[str, list[torch.Tensor]]:
    import ringtrain as rt

    return {"gather": _sparse_run(True, False, rt.size()), "dense": _sparse_run(True, True, rt.size())}


@pytest.mark.timeout(120)
def test_sparse_embedding_gradients_match_one_process() -> None:
    results = run_world(_sparse_all, 2, timeout=110)
    expected = _sparse_run(False, False, n=2)
    for rank, per_rank in enumerate(results):
        for mode in ("gather", "dense"):
            for got, want in zip(per_rank[mode], expected, strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, k=mode, r=rank: f"{k} rank {r}: {m}")


# -- mistakes get their own message ------------------------------------------------------

def _zero_grad_mid_step() -> str:
    import ringtrain as rt

    model = torch.nn.Linear(3, 1)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  backward_passes_per_step=2)
    model(torch.ones(2, 3)).sum().backward()
    try:  # mid-accumulation (test_optimizer_ddp_patterns has the other cases)
        opt.zero_grad()
    except rt.errors.ConfigError as exc:
        message = str(exc)
    else:
        message = ""
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad()  # after step(): fine
    try:
        rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bogus_option=1)
    except rt.errors.ConfigError as exc:
        message += "\n" + str(exc)
    return message


@pytest.mark.timeout(60)
def test_zero_grad_between_backward_and_step_and_unknown_options_are_named() -> None:
    message = run_world(_zero_grad_mid_step, 1, timeout=50)[0]
    first, second = message.split("\n")
    assert "zero_grad() was called after backward() and before step()" in first
    assert "bogus_option" in second and "strategy" not in second.split(";")[0]
