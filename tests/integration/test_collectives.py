"""Each collective on real Gloo ranks against a reference computed locally."""

from __future__ import annotations

import pytest
import torch
from ringtest import run_world


def _local(rank: int) -> torch.Tensor:
    return torch.arange(7, dtype=torch.float32) * (rank + 1) - rank


def _collectives() -> dict[str, object]:
    import ringtrain as rt

    r, n = rt.rank(), rt.size()
    out: dict[str, object] = {"rank": r, "size": n, "local": (rt.local_rank(), rt.local_size()),
                              "cross": (rt.cross_rank(), rt.cross_size()), "dev": str(rt.device())}
    t = _local(r)
    out["average"] = rt.allreduce(t)
    out["sum"] = rt.allreduce(t, op=rt.Sum, name="grad.w")
    out["min"] = rt.allreduce(t, op=rt.Min)
    out["max"] = rt.allreduce(t, op=rt.Max)
    inplace = t.clone()
    rt.allreduce_(inplace, op=rt.Sum)
    out["inplace"] = inplace
    # In-place on strided views: only the view's elements change, reduced (Gloo alone
    # reduced the wrong elements of one), whichever algorithm.
    strided = {}
    for algo in ("native", "ring", "ps"):
        base = torch.stack([_local(r)] * 3, dim=1)  # (7, 3): column views are strided
        rt.allreduce_(base[::2, 1], op=rt.Sum, algorithm=algo)
        strided[algo] = base
    out["strided"] = strided
    cast = torch.stack([_local(r)] * 2, dim=1)
    rt.broadcast_(cast[:, 0], root_rank=1)
    out["broadcast_strided"] = cast
    handles = [rt.allreduce_async(t * k, op=rt.Sum) for k in (1, 2)]
    out["async"] = [rt.synchronize(h) for h in handles]
    out["untouched"] = torch.equal(t, _local(r))  # out-of-place forms leave the input alone
    out["allgather"] = rt.allgather(torch.full((r + 1, 2), float(r)))  # uneven first dims
    out["broadcast"] = rt.broadcast(t, root_rank=n - 1)
    b = t.clone()
    rt.broadcast_(b, root_rank=1)
    out["broadcast_"] = b
    out["alltoall"] = rt.alltoall(torch.arange(n * 2) + 100 * r)
    splits = [k + 1 for k in range(n)]  # send k+1 rows to rank k
    out["alltoall_uneven"] = rt.alltoall(torch.full((sum(splits),), float(r)), splits=splits)
    out["reducescatter"] = rt.reducescatter(torch.arange(2.0 * n + 1) * (r + 1), op=rt.Sum)
    out["reducescatter_avg"] = rt.reducescatter(torch.full((n + 1, 3), float(r)))
    out["reducescatter_max"] = rt.reducescatter(torch.arange(n) * 10 + r, op=rt.Max)
    out["bobj"] = rt.broadcast_object({"from": r, "list": [r]}, root_rank=1)
    out["gobj"] = rt.allgather_object(("r", r))
    rt.barrier()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_local_reference(n: int) -> None:
    results = run_world(_collectives, n, timeout=50)
    locals_ = [_local(r) for r in range(n)]
    total = sum(locals_)
    for r, out in enumerate(results):
        assert out["rank"] == r and out["size"] == n and out["local"] == (r, n) and out["cross"] == (0, 1)
        assert out["dev"] == "cpu"
        torch.testing.assert_close(out["average"], total / n)
        torch.testing.assert_close(out["sum"], total)
        torch.testing.assert_close(out["inplace"], total)
        for algo, base in out["strided"].items():
            want = torch.stack([locals_[r]] * 3, dim=1)
            want[::2, 1] = total[::2]
            assert torch.equal(base, want), algo
        want = torch.stack([locals_[r], locals_[r]], dim=1)
        want[:, 0] = locals_[1]
        assert torch.equal(out["broadcast_strided"], want)
        torch.testing.assert_close(out["min"], torch.stack(locals_).min(0).values)
        torch.testing.assert_close(out["max"], torch.stack(locals_).max(0).values)
        torch.testing.assert_close(out["async"][1], 2 * total)
        assert out["untouched"]
        expected_gather = torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)])
        torch.testing.assert_close(out["allgather"], expected_gather)
        torch.testing.assert_close(out["broadcast"], locals_[n - 1])
        torch.testing.assert_close(out["broadcast_"], locals_[1])
        torch.testing.assert_close(out["alltoall"], torch.tensor([100 * k + 2 * r + j for k in range(n) for j in (0, 1)]))
        torch.testing.assert_close(out["alltoall_uneven"], torch.tensor([float(k) for k in range(n) for _ in range(r + 1)]))
        full = sum(torch.arange(2.0 * n + 1) * (k + 1) for k in range(n))
        start = 2 * r + min(r, 1)  # the first rank gets the extra row
        torch.testing.assert_close(out["reducescatter"], full[start : start + 2 + (1 if r == 0 else 0)])
        rows = 2 if r == 0 else 1  # n + 1 rows: the first rank gets the extra one
        torch.testing.assert_close(out["reducescatter_avg"], torch.full((rows, 3), (n - 1) / 2))
        torch.testing.assert_close(out["reducescatter_max"], torch.tensor([10 * r + n - 1]))
        assert out["bobj"] == {"from": 1, "list": [1]}
        assert out["gobj"] == [("r", k) for k in range(n)]


def _checkpoint_world(directory: str) -> dict[str, object]:
    import os

    import ringtrain as rt

    path = os.path.join(directory, "shared.ckpt")
    # Every rank calls save at once: only rank 0 writes, the file is complete.
    rt.checkpoint.save(path, {"w": torch.full((3,), float(rt.rank())), "rank": rt.rank()})
    rt.barrier()
    state = rt.checkpoint.load(path)
    bad = os.path.join(directory, "bad.ckpt")
    if rt.rank() == 0:
        with open(bad, "wb") as f:
            f.write(b"RTCKPT01" + b"\0" * 10)
    rt.barrier()
    try:
        rt.checkpoint.load(bad)
        err = None
    except rt.errors.CheckpointError as exc:
        err = str(exc)
    return {"state": state, "err": err}


@pytest.mark.timeout(60)
def test_checkpoint_load_gives_every_rank_rank0_state(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_world(_checkpoint_world, 3, str(tmp_path), timeout=50)
    for out in results:
        assert out["state"]["rank"] == 0 and torch.equal(out["state"]["w"], torch.zeros(3))
        assert out["err"] is not None and "bad.ckpt" in out["err"]  # every rank gets the error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.ckpt", "shared.ckpt"]


def _not_initialised() -> str:
    import ringtrain as rt

    try:
        rt.allreduce(torch.ones(1))
    except rt.errors.NotInitializedError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(30)
def test_collective_before_init_is_a_clear_error() -> None:
    (msg,) = run_world(_not_initialised, 1, init=False, timeout=25)
    assert "rt.init()" in msg
