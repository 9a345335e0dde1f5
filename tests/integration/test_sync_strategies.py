"""ring and ps on real Gloo processes: equal to the backend's allreduce, in the optimizer
too, and mismatched tensors or settings caught before the first exchange.

Starting ranks dominates these tests (torch import, then torch._dynamo's on the first
optimizer), so the N=3 world runs every check once and several tests read its results.
"""

from __future__ import annotations

import time

import pytest
import torch
from ringtest import run_world

STALL = 3.0  # seconds; RINGTRAIN_STALL_TIMEOUT in worlds that test faults
SHAPES = [(), (1,), (7,), (3, 5), (1000,), (257, 33)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def optimizer(model: torch.nn.Module, **kw: object):
    import ringtrain as rt

    return rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), **kw)


def caught(fn) -> tuple[str, str, float]:
    """Run fn; (error type, message, seconds) of the ringtrain error it raised."""
    import ringtrain as rt

    t0 = time.monotonic()
    try:
        fn()
    except rt.errors.RingtrainError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0



def _strategies(n: int) -> dict[str, object]:
    from ringtrain import sync

    return {
        "ring": "ring",
        "ring/3 chunks": sync.Ring(chunks_per_rank=3),
        "ps k=1": "ps",
        "ps k=2": sync.ParameterServer(servers=min(2, n)),
        "ps k=N": sync.ParameterServer(servers=n),
    }


# Unit roundoff and half the smallest subnormal spacing of each wire dtype.
WIRE = {torch.float16: (2.0**-11, 2.0**-25), torch.bfloat16: (2.0**-8, 0.0),
        torch.float32: (2.0**-24, 0.0)}


def _compression_errors(r: int, n: int) -> list[str]:
    """fp16/bf16 on the wire, as the optimizer does it (scale by 1/N in float32, narrow,
    Sum in the wire dtype, widen), stays within the rounding bound of n-1 additions
    plus the narrowing: |error| <= n * u * sum_i |x_i / n| + (2n - 1) * subnormal step."""
    import ringtrain as rt

    g = torch.Generator().manual_seed(77 + r)
    grad = torch.randn(4096, generator=g) * 1e-2
    parts = rt.allgather(grad.double().unsqueeze(0))  # [n, 4096]
    exact = parts.mean(0)
    abs_sum = (parts / n).abs().sum(0)
    failures = []
    for label, alg in {"native": "native", **_strategies(n)}.items():
        for wire, (u, sub) in WIRE.items():
            t = (grad / n).to(wire)
            rt.allreduce_(t, rt.Sum, algorithm=alg)
            err = (t.double() - exact).abs()
            bound = 1.05 * n * u * abs_sum + (2 * n - 1) * sub
            if not bool((err <= bound).all()):
                failures.append(f"{label} {wire}: error {err.max().item():.3g} over the bound")
    return failures


def _equality() -> dict[str, object]:
    import ringtrain as rt

    r, n = rt.rank(), rt.size()
    failures: list[str] = []
    digests: list[float] = []
    for label, alg in _strategies(n).items():
        for dtype in DTYPES:
            for shape in SHAPES:
                g = torch.Generator().manual_seed(31 * r + len(shape))
                x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
                want = rt.allreduce(x, rt.Average)
                got = rt.allreduce(x, rt.Average, name=f"{label}{shape}", algorithm=alg)
                if got.shape != x.shape or got.dtype != dtype:
                    failures.append(f"{label} {dtype} {shape}: shape/dtype changed")
                elif not torch.allclose(got.double(), want.double(), rtol=TOL[dtype], atol=TOL[dtype]):
                    err = (got.double() - want.double()).abs().max().item()
                    failures.append(f"{label} {dtype} {shape}: max error {err:.3g}")
                digests.append(float(got.double().sum()))
        # Other ops, integers and a non-contiguous tensor (staged and written back).
        x = (torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1)).t()
        for op in (rt.Sum, rt.Min, rt.Max, rt.Average):
            if not torch.equal(rt.allreduce(x, op, algorithm=alg), rt.allreduce(x, op)):
                failures.append(f"{label} op {op.name} on a transposed tensor")
        xi = torch.arange(-9, 10, dtype=torch.int64) * (r + 2)
        if not torch.equal(rt.allreduce(xi, rt.Average, algorithm=alg), rt.allreduce(xi, rt.Average)):
            failures.append(f"{label} int64 average")
        inplace = x.clone()
        rt.allreduce_(inplace, rt.Sum, algorithm=alg)
        if not torch.equal(inplace, rt.allreduce(x, rt.Sum)):
            failures.append(f"{label} in-place on a non-contiguous tensor")
    failures += _compression_errors(r, n)
    # Several exchanges in flight at once finish in order with the right values.
    xs = [torch.full((1000 + i,), float(r + i)) for i in range(6)]
    handles = [rt.allreduce_async(t, rt.Sum, algorithm=("ring", "ps")[i % 2]) for i, t in enumerate(xs)]
    for i, h in enumerate(handles):
        want = sum(float(k + i) for k in range(n))
        if not bool((rt.synchronize(h) == want).all()):
            failures.append(f"async exchange {i}")
    return {"failures": failures, "digests": digests}


STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _train_all() -> dict[str, list[torch.Tensor]]:
    import ringtrain as rt

    r, n = rt.rank(), rt.size()
    configs = {
        "native": {"strategy": "native"},
        "ring": {"strategy": "ring"},
        "ps k=1": {"strategy": "ps"},
        "ps k=2": {"strategy": "ps", "ps_servers": 2},
        "ps k=N": {"strategy": "ps", "ps_servers": n, "stall_timeout": 30},
    }
    out = {}
    for label, cfg in configs.items():
        model = _model()
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=model.named_parameters(),
                                      fusion_mb=0.0005, **cfg)  # several buckets
        for step in range(STEPS):
            x, y = _batch(step, 4 * n)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[4 * r: 4 * r + 4]), y[4 * r: 4 * r + 4]).backward()
            opt.step()
        out[label] = [p.detach().clone() for p in model.parameters()]
    return out


def _reference(n: int) -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, 4 * n)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _by_name_without_importing_sync() -> str:
    """rt.allreduce(t, algorithm="ring") right after rt.init(), with no explicit import of
    ringtrain.sync (the package facade must register "ring" and "ps"): 'ok' or the error."""
    import ringtrain as rt

    try:
        rt.allreduce(torch.ones(3), algorithm="ring")
        rt.allreduce(torch.ones(3), algorithm="ps")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _world3() -> dict[str, object]:
    by_name = _by_name_without_importing_sync()  # first: nothing has imported sync yet
    return {"by_name": by_name, "equality": _equality(), "trained": _train_all(),
            "mismatches": _mismatches()}


@pytest.fixture(scope="module")
def world3() -> list[dict[str, object]]:
    return run_world(_world3, 3, timeout=110)


def _check_equality(results: list[dict[str, object]]) -> None:
    for rank, out in enumerate(results):
        assert out["failures"] == [], f"rank {rank}: {out['failures']}"
    # Every rank holds the same result for every exchange.
    assert all(out["digests"] == results[0]["digests"] for out in results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 4])
def test_ring_and_ps_equal_native_allreduce(n: int) -> None:
    _check_equality(run_world(_equality, n, timeout=50))


@pytest.mark.timeout(120)
def test_ring_and_ps_equal_native_allreduce_on_3_ranks(world3) -> None:
    _check_equality([out["equality"] for out in world3])


@pytest.mark.timeout(120)
def test_ring_and_ps_work_by_name_right_after_import(world3) -> None:
    assert [out["by_name"] for out in world3] == ["ok"] * 3


@pytest.mark.timeout(120)
def test_optimizer_strategies_train_like_one_process(world3) -> None:
    want = _reference(3)
    for rank, out in enumerate(world3):
        for label, params in out["trained"].items():
            for got, ref in zip(params, want, strict=True):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, lab=label, rk=rank: f"rank {rk} {lab}: {m}")


def _mismatches() -> list[tuple[str, str, float]]:
    import ringtrain as rt

    r = rt.rank()
    out = []
    rt.barrier()  # start together: the timings below must show detection, not arrival

    def step(model: torch.nn.Module, **kw: object):
        opt = optimizer(model, **kw)  # outside the timed part (the first one imports a lot)

        def run() -> None:
            model(torch.ones(2, 4, dtype=next(model.parameters()).dtype)).sum().backward()
            opt.step()
        return run

    # Shape: rank 2's hidden layer is wider.
    out.append(caught(step(torch.nn.Sequential(torch.nn.Linear(4, 8 if r != 2 else 9),
                                                torch.nn.Linear(8 if r != 2 else 9, 2)))))
    # Dtype: rank 1 trains in float64.
    dtype = torch.float64 if r == 1 else torch.float32
    out.append(caught(step(torch.nn.Linear(4, 2).to(dtype))))
    # Same model, different settings: the number of parameter servers.
    out.append(caught(step(torch.nn.Linear(4, 2), strategy="ps", ps_servers=1 + (r == 0))))
    # And a correct model still trains afterwards.
    out.append(caught(step(torch.nn.Linear(4, 2), strategy="ring")))
    return out


@pytest.mark.timeout(120)
def test_shape_dtype_and_setting_mismatches_fail_on_every_rank(world3) -> None:
    results = [out["mismatches"] for out in world3]
    for rank, (shape, dtype, setting, fine) in enumerate(results):
        assert shape[0] == "MismatchError", (rank, shape)
        assert "'1.weight' [2, 8] float32 on ranks 0, 1 but '1.weight' [2, 9] float32 on rank 2" in shape[1]
        assert dtype[0] == "MismatchError", (rank, dtype)
        assert "float32 on ranks 0, 2 but" in dtype[1] and "float64 on rank 1" in dtype[1]
        assert setting[0] == "MismatchError" and "setting ps_servers='2' on rank 0 but '1' on ranks 1, 2" in setting[1]
        assert fine[0] == "no error", fine
        assert all(r[2] < STALL for r in (shape, dtype, setting))  # found at once, no timeout
    assert len({res[0][1] for res in results}) == 1  # the same message on every rank
