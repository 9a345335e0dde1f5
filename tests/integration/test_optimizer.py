"""DistributedOptimizer on real Gloo processes: data-parallel equivalence and options."""

from __future__ import annotations

import pytest
import torch
from ringtest import run_world

STEPS = 10
BATCH = 4  # per rank


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _data(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _reference(n: int) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _data(step, n * BATCH)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(passes: int, fusion_mb: float) -> list[torch.Tensor]:
    import ringtrain as rt

    model = _model(seed=rt.rank())  # different on purpose: broadcast must fix it
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        fusion_mb=fusion_mb,
    )
    for step in range(STEPS):
        x, y = _data(step, rt.size() * BATCH)
        mine = slice(rt.rank() * BATCH, (rt.rank() + 1) * BATCH)
        xs, ys = x[mine], y[mine]
        opt.zero_grad()
        for micro in range(passes):
            part = slice(micro * BATCH // passes, (micro + 1) * BATCH // passes)
            # Horovod's semantics: the passes are summed, so the script divides by them.
            (torch.nn.functional.mse_loss(model(xs[part]), ys[part]) / passes).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("passes", [1, 2])
def test_n_ranks_equal_one_rank_with_concatenated_batch(n: int, passes: int) -> None:
    # A tiny fusion size forces several buckets, so bucket order and packing are exercised.
    results = run_world(_train, n, passes, 0.0005, timeout=80)
    expected = _reference(n)
    for rank_params in results:
        for got, want in zip(rank_params, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _train_in_place(passes: int) -> tuple[list[torch.Tensor], bool]:
    # zero_grad(set_to_none=False) keeps each .grad a view of its fusion buffer, so
    # backward accumulates straight into the buffer: one shared storage (the model fits
    # one bucket), the same every step.
    import ringtrain as rt

    model = _model(seed=rt.rank())
    pointers: set[tuple[int, ...]] = set()
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), backward_passes_per_step=passes,
    )
    for step in range(STEPS):
        x, y = _data(step, rt.size() * BATCH)
        mine = slice(rt.rank() * BATCH, (rt.rank() + 1) * BATCH)
        opt.zero_grad(set_to_none=False)
        for micro in range(passes):
            part = slice(micro * BATCH // passes, (micro + 1) * BATCH // passes)
            (torch.nn.functional.mse_loss(model(x[mine][part]), y[mine][part]) / passes).backward()
        opt.step()
        if step > 0:
            pointers.add(tuple({p.grad.untyped_storage().data_ptr() for p in model.parameters()}))
    one_storage = len(pointers) == 1 and len(next(iter(pointers))) == 1
    return [p.detach().clone() for p in model.parameters()], one_storage


@pytest.mark.timeout(90)
@pytest.mark.parametrize("passes", [1, 2])
def test_gradients_accumulated_in_place_give_the_same_training(passes: int) -> None:
    results = run_world(_train_in_place, 2, passes, timeout=80)
    expected = _reference(2)
    for rank_params, stable in results:
        assert stable, "gradients are not views of one fusion buffer that stays put"
        for got, want in zip(rank_params, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _features() -> dict[str, object]:
    import ringtrain as rt

    out: dict[str, object] = {}
    r, n = rt.rank(), rt.size()

    # An unused parameter on one rank must not deadlock: it contributes zeros.
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    params = list(a.named_parameters(prefix="a")) + list(b.named_parameters(prefix="b"))
    opt = rt.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0),
                                  named_parameters=params)
    x = torch.ones(1, 3)
    loss = a(x).sum() + (b(x).sum() if r == 0 else 0.0)
    loss.backward()
    opt.synchronize()
    out["unused_b_bias_grad"] = b.bias.grad.clone()  # rank 0 has ones, others nothing -> 1/n
    with opt.skip_synchronize():
        opt.step()

    # Partial accumulation: step() after 1 of 3 passes exchanges that one pass.
    w = torch.nn.Parameter(torch.zeros(2))
    opt2 = rt.DistributedOptimizer(torch.optim.SGD([w], lr=1.0),
                                   named_parameters=[("w", w)], backward_passes_per_step=3)
    (w * torch.tensor([1.0, 2.0]) * (r + 1)).sum().backward()
    opt2.step()
    out["partial_w"] = w.detach().clone()  # -= mean over ranks of (r+1)*[1,2]

    # Clip between synchronize and step sees the averaged gradient.
    v = torch.nn.Parameter(torch.zeros(4))
    opt3 = rt.DistributedOptimizer(torch.optim.SGD([v], lr=1.0), named_parameters=[("v", v)])
    (v * float(10 * (r + 1))).sum().backward()
    opt3.synchronize()
    out["synced_grad"] = v.grad.clone()
    torch.nn.utils.clip_grad_norm_([v], 1.0)
    with opt3.skip_synchronize():
        opt3.step()
    out["clipped_v"] = v.detach().clone()

    # Broadcast of Adam state after some steps with rank-dependent gradients.
    torch.manual_seed(r)
    m = torch.nn.Linear(4, 2)
    adam = torch.optim.Adam(m.parameters(), lr=0.01 * (r + 1))
    for _ in range(r + 1):
        m(torch.randn(3, 4)).sum().backward()
        adam.step()
    rt.broadcast_parameters(m.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(adam, root_rank=0)
    out["adam_state"] = adam.state_dict()
    out["adam_params"] = [p.detach().clone() for p in m.parameters()]

    # fp16 compression stays close to the fp32 exchange.
    q = torch.nn.Parameter(torch.zeros(1000))
    opt4 = rt.DistributedOptimizer(torch.optim.SGD([q], lr=1.0), named_parameters=[("q", q)],
                                   compression=rt.Compression.fp16)
    g = torch.Generator().manual_seed(r)
    (q * torch.randn(1000, generator=g)).sum().backward()
    opt4.synchronize()
    exact = rt.allreduce(torch.randn(1000, generator=torch.Generator().manual_seed(r)))
    out["fp16_err"] = float((q.grad - exact).abs().max())
    out["n"] = n
    return out


@pytest.mark.timeout(60)
def test_optimizer_features_on_three_ranks() -> None:
    results = run_world(_features, 3, timeout=50)
    n = 3
    for out in results:
        torch.testing.assert_close(out["unused_b_bias_grad"], torch.full((3,), 1.0 / n))
        mean = sum(k + 1 for k in range(n)) / n
        torch.testing.assert_close(out["partial_w"], -mean * torch.tensor([1.0, 2.0]))
        torch.testing.assert_close(out["synced_grad"], torch.full((4,), 10.0 * mean))
        assert float(out["clipped_v"].norm()) == pytest.approx(1.0, rel=1e-5)
        assert out["fp16_err"] < 5e-3
    ref_state, ref_params = results[0]["adam_state"], results[0]["adam_params"]
    for out in results[1:]:
        for got, want in zip(out["adam_params"], ref_params, strict=True):
            torch.testing.assert_close(got, want)
        assert out["adam_state"]["param_groups"][0]["lr"] == ref_state["param_groups"][0]["lr"]
        for key, st in ref_state["state"].items():
            for name, value in st.items():
                torch.testing.assert_close(out["adam_state"]["state"][key][name], value)
