"""ringtrain.horovod's collectives behave as horovod.torch's (Horovod's documentation and
its test suite are the spec; these are our own tests of the same behaviours)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from ringtest import run_world


def _hvd() -> Any:
    import ringtrain.horovod as hvd

    hvd.init()
    return hvd


def _ops() -> dict[str, Any]:
    hvd = _hvd()
    r, n = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    # Names match operations across ranks in any order (torch.distributed would pair the
    # wrong tensors here).
    a, b = torch.full((3,), float(r + 1)), torch.full((5,), 10.0 * (r + 1))
    if r == 0:
        ha, hb = hvd.allreduce_async(a, name="a", op=hvd.Sum), hvd.allreduce_async(b, name="b", op=hvd.Sum)
    else:
        hb, ha = hvd.allreduce_async(b, name="b", op=hvd.Sum), hvd.allreduce_async(a, name="a", op=hvd.Sum)
    out["any_order"] = (hvd.synchronize(ha).tolist(), hvd.synchronize(hb).tolist())
    # Deprecated average= and the ops
    t = torch.tensor([float(r + 1), -float(r + 1)])
    out["average"] = hvd.allreduce(t, average=True).tolist()
    out["min"] = hvd.allreduce(t, op=hvd.Min).tolist()
    out["product"] = hvd.allreduce(t, op=hvd.Product).tolist()
    # Integers: prescale in float64, truncated back; average truncates toward zero
    ints = torch.tensor([7, -7], dtype=torch.int32)
    out["int_prescale"] = hvd.allreduce(ints, op=hvd.Sum, prescale_factor=0.5).tolist()
    out["int_average"] = hvd.allreduce(ints + r, op=hvd.Average).tolist()
    # ... and with a postscale, the sum is scaled once by postscale/size, then truncated
    out["int_average_post"] = hvd.allreduce(ints + r, op=hvd.Average, postscale_factor=2.0).tolist()
    out["int_rs_post"] = hvd.reducescatter(torch.tensor([7, -7], dtype=torch.int64) + r,
                                           op=hvd.Average, postscale_factor=0.7).tolist()
    # In place, grouped, allgather with uneven first dims, broadcast, alltoall
    c = torch.ones(2) * (r + 1)
    hvd.allreduce_(c, op=hvd.Sum)
    out["inplace"] = c.tolist()
    out["grouped"] = [x.tolist() for x in hvd.grouped_allreduce([torch.ones(2), torch.ones(3) * r], op=hvd.Sum)]
    out["allgather"] = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int16)).tolist()
    out["broadcast"] = hvd.broadcast(torch.tensor([float(r)]), root_rank=n - 1).tolist()
    got, splits = hvd.alltoall(torch.arange(3.0) + 10 * r, splits=torch.tensor([1, 2] if r == 0 else [2, 1],
                                                                               dtype=torch.int32))
    out["alltoall"] = (got.tolist(), splits.tolist(), splits.dtype == torch.int32)
    out["reducescatter"] = hvd.reducescatter(torch.arange(4.0) * (r + 1), op=hvd.Sum).tolist()
    out["objects"] = (hvd.broadcast_object({"x": r}, root_rank=1), hvd.allgather_object(r * 10))
    # A handle is asynchronous; poll is False before the others submitted
    h = hvd.allreduce_async(torch.ones(1), name="late")
    out["polled_early"] = hvd.poll(h) if r == 0 else None
    hvd.barrier()
    out["late"] = hvd.synchronize(h).tolist()
    # Errors: the same clear error on every rank, the job goes on
    try:
        hvd.allreduce(torch.ones(3 + r), name="bad")
    except RuntimeError as exc:
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    hvd.allreduce_async(torch.ones(1), name="dup")
    try:
        hvd.allreduce_async(torch.ones(1), name="dup")
    except ValueError as exc:
        out["duplicate"] = str(exc)
    hvd.barrier()
    try:
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum)
    except RuntimeError as exc:
        out["rs_adasum"] = str(exc)
    try:
        hvd.alltoall(torch.ones(n + 1))
    except ValueError as exc:
        out["a2a_split"] = str(exc)
    out["after_errors"] = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    out["flags"] = (hvd.gloo_built(), hvd.mpi_built(), hvd.nccl_built(), hvd.is_homogeneous())
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_collectives_match_by_name_and_compute_as_horovod() -> None:
    r0, r1 = run_world(_ops, 2, init=False, timeout=110)
    for rank, o in enumerate((r0, r1)):
        assert o["any_order"] == ([3.0] * 3, [30.0] * 5)
        assert o["average"] == [1.5, -1.5] and o["min"] == [1.0, -2.0] and o["product"] == [2.0, 2.0]
        assert o["int_prescale"] == [6, -6]  # 7 * 0.5 = 3.5 -> 3 on each rank, summed
        assert o["int_average"] == [7, -6]  # (7 + 8) / 2 = 7.5 -> 7; (-7 + -6) / 2 = -6.5 -> -6
        assert o["int_average_post"] == [15, -13]  # 15 * 2/2, -13 * 2/2 (not 7*2, -6*2)
        assert o["int_rs_post"] == [[5], [-4]][rank]  # 15 * 0.35 = 5.25; -13 * 0.35 = -4.55
        assert o["inplace"] == [3.0, 3.0]
        assert o["grouped"] == [[2.0, 2.0], [1.0, 1.0, 1.0]]
        assert o["allgather"] == [[0, 0], [1, 1], [1, 1]]
        assert o["broadcast"] == [1.0]
        assert o["reducescatter"] in ([0.0, 3.0], [6.0, 9.0])
        assert o["objects"] == ({"x": 1}, [0, 10])
        assert o["late"] == [1.0]
        assert o["mismatch"].startswith("MismatchError: Mismatched allreduce tensor shapes for 'allreduce.bad'")
        assert "(3,) on rank 0; (4,) on rank 1" in o["mismatch"]
        assert "still in progress" in o["duplicate"]
        assert "Adasum" in o["rs_adasum"] and "multiple of the process set size" in o["a2a_split"]
        assert o["after_errors"] == 2.0
        assert o["flags"] == (True, False, 0, True)
    assert r0["mismatch"] == r1["mismatch"]
    assert r0["alltoall"] == ([0.0, 10.0, 11.0], [1, 2], True)
    assert r1["alltoall"] == ([1.0, 2.0, 12.0], [2, 1], True)
    assert r0["reducescatter"] == [0.0, 3.0] and r1["reducescatter"] == [6.0, 9.0]


def _grads() -> dict[str, Any]:
    hvd = _hvd()
    r = hvd.rank()
    out = {}
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    out["allreduce"] = x.grad.tolist()
    y = torch.ones(r + 1, 2, requires_grad=True)
    g = hvd.allgather(y)
    (g * torch.arange(g.shape[0], dtype=torch.float32).unsqueeze(1)).sum().backward()
    out["allgather"] = y.grad.tolist()
    z = torch.ones(2, requires_grad=True)
    hvd.broadcast(z, root_rank=0).sum().backward()
    out["broadcast"] = z.grad.tolist()
    w = torch.ones(4, requires_grad=True)
    hvd.reducescatter(w, op=hvd.Average).sum().backward()
    out["reducescatter"] = w.grad.tolist()
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
def test_collectives_are_differentiable_as_horovods() -> None:
    r0, r1 = run_world(_grads, 2, init=False, timeout=110)
    assert r0["allreduce"] == r1["allreduce"] == [2.0] * 3
    # rows 0 (rank 0) and 1..2 (rank 1), gradient averaged over ranks then sliced
    assert r0["allgather"] == [[0.0, 0.0]] and r1["allgather"] == [[1.0, 1.0], [2.0, 2.0]]
    assert r0["broadcast"] == [1.0, 1.0] and r1["broadcast"] == [0.0, 0.0]
    assert r0["reducescatter"] == r1["reducescatter"] == [1.0] * 4


def _adasum_numpy(vectors: list[np.ndarray]) -> np.ndarray:
    """The published formula, written directly: pairs in rank order, then pairs of pairs."""
    def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        dot = float(a @ b)
        return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b

    level = vectors
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _vectors(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal(6) for _ in range(n)]


def _adasum(n: int) -> list[float]:
    hvd = _hvd()
    v = torch.tensor(_vectors(n)[hvd.rank()])
    out = hvd.allreduce(v, op=hvd.Adasum).tolist()
    hvd.shutdown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_adasum_matches_a_numpy_implementation_of_the_formula(n: int) -> None:
    results = run_world(_adasum, n, n, init=False, timeout=110)
    expected = _adasum_numpy(_vectors(n))
    for got in results:
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def _sync_bn() -> dict[str, Any]:
    hvd = _hvd()
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    full = torch.randn(4 * n, 3, 5)  # every rank builds the whole batch, keeps its rows
    sbn, bn = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    for m in (sbn, bn):
        with torch.no_grad():
            m.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    mine = full[4 * r: 4 * (r + 1)].clone().requires_grad_()
    whole = full.clone().requires_grad_()
    out = sbn(mine)
    ref = bn(whole)
    (out * torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape).cos()).sum().backward()
    # the reference loss is the sum of every rank's loss
    loss = 0
    for k in range(n):
        part = ref[4 * k: 4 * (k + 1)]
        loss = loss + (part * torch.arange(part.numel(), dtype=torch.float32).reshape(part.shape).cos()).sum()
    loss.backward()
    res = {
        "out": (out - ref[4 * r: 4 * (r + 1)]).abs().max().item(),
        "running_mean": (sbn.running_mean - bn.running_mean).abs().max().item(),
        "running_var": (sbn.running_var - bn.running_var).abs().max().item(),
        "dx": (mine.grad - whole.grad[4 * r: 4 * (r + 1)]).abs().max().item(),
        "dw": (hvd.allreduce(sbn.weight.grad, op=hvd.Sum) - bn.weight.grad).abs().max().item(),
        "db": (hvd.allreduce(sbn.bias.grad, op=hvd.Sum) - bn.bias.grad).abs().max().item(),
    }
    hvd.shutdown()
    return res


@pytest.mark.timeout(120)
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch() -> None:
    for res in run_world(_sync_bn, 2, init=False, timeout=110):
        for key, err in res.items():
            assert err < 1e-5, (key, err)
