"""BatchNorm models in a ringtrain-native script (``rt.init()``, no ``hvd.init()``):
``ringtrain.horovod.SyncBatchNorm`` (and its ``convert_sync_batchnorm``) trains as one
process on the concatenated batch, and ``rt.broadcast_parameters`` refuses what it
cannot overwrite in place (a module, a non-tensor entry) on every rank. One 2-rank world
runs every scenario; the tests read it. Each test failed before its fix (the comment
says how)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import error_of, run_scenarios, run_world, scenario_results

#: A scenario that leaves the ranks out of step fails the world quickly.
STALL_S = "8"
BATCH = 4  # per rank


def _in_step() -> float:
    """2.0 while the ranks are still in step."""
    import ringtrain as rt

    return float(rt.allreduce(torch.ones(1), op=rt.Sum).item())


def _model() -> torch.nn.Module:
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 3), nn.BatchNorm1d(3))


def _batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH * size, 2, 6, 6, generator=g) * 3 + 1, torch.randint(0, 3, (BATCH * size,), generator=g)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: slice, size: int) -> None:
    for step in range(2):  # the second step starts from the first's running statistics
        x, y = _batch(step, size)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()


def _native_sync_batch_norm() -> dict[str, Any]:
    """A DDP script's ``convert_sync_batchnorm`` + ``rt.DistributedOptimizer`` against one
    process with torch's BatchNorm on the whole batch: largest difference of any entry
    of the state_dict (parameters, running statistics, num_batches_tracked)."""
    import ringtrain as rt
    import ringtrain.horovod as hvd

    ref = _model()
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), slice(None), rt.size())
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(_model())
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters())
    r = rt.rank()
    _train(model, opt, slice(BATCH * r, BATCH * (r + 1)), rt.size())
    want, got = ref.state_dict(), model.state_dict()
    return {"kinds": sorted({type(m).__name__ for m in model.modules() if "BatchNorm" in type(m).__name__}),
            "keys": sorted(got) == sorted(want),
            "err": max(float((got[k].double() - want[k].double()).abs().max()) for k in want),
            "after": _in_step()}


def _broadcast_refusals() -> dict[str, Any]:
    import ringtrain as rt

    r = rt.rank()
    torch.manual_seed(r)
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    mine = seq[0].weight.detach().clone()
    same = {"w": torch.full((2,), float(r)), "epoch": r}
    one: dict[str, Any] = {"a": torch.full((2,), float(r)), "b": None if r == 1 else torch.ones(1)}
    return {"module": error_of(lambda: rt.broadcast_parameters(seq, 0)),
            "module_kept": bool(torch.equal(seq[0].weight, mine)),
            "same": error_of(lambda: rt.broadcast_parameters(same, 0)), "same_w": same["w"].tolist(),
            "one": error_of(lambda: rt.broadcast_parameters(one, 0)), "one_a": one["a"].tolist(),
            "after": _in_step()}


def _world() -> dict[str, Any]:
    import ringtrain as rt
    import ringtrain.horovod as hvd

    out: dict[str, Any] = {}
    # Before rt.init(): Horovod's error (there, the forward's size() raises it).
    out["uninitialised"] = error_of(lambda: hvd.SyncBatchNorm(3)(torch.randn(4, 3)))
    rt.init()
    out.update(run_scenarios([("native_sync_batch_norm", _native_sync_batch_norm),
                              ("broadcast_refusals", _broadcast_refusals)]))
    rt.shutdown()
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, Any]]:
    return run_world(_world, 2, init=False, env={"RINGTRAIN_STALL_TIMEOUT": STALL_S}, timeout=100)


@pytest.mark.timeout(120)
def test_sync_batch_norm_under_rt_init_trains_as_one_process_on_the_whole_batch(world: list[dict[str, Any]]) -> None:
    # Before: the forward raised ConfigError ("ProcessSet(process_set_id=-1) is not
    # registered; pass it to hvd.init(...)"), and convert_sync_batchnorm did not exist.
    for out in scenario_results(world, "native_sync_batch_norm", after=2.0):
        assert out["kinds"] == ["SyncBatchNorm"] and out["keys"], out
        assert out["err"] <= 1e-5, out


@pytest.mark.timeout(120)
def test_sync_batch_norm_before_any_init_is_horovods_error(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["uninitialised"] is not None and "hvd.init()" in out["uninitialised"][1], out


@pytest.mark.timeout(120)
def test_broadcast_parameters_refuses_a_module_and_non_tensors_on_every_rank(world: list[dict[str, Any]]) -> None:
    # Before: an nn.Sequential iterated over its layers and broadcast nothing (each rank
    # kept its own initial weights), and a non-tensor entry was skipped (each rank kept
    # its own epoch), silently.
    r0, r1 = scenario_results(world, "broadcast_refusals", after=2.0)
    for out, rank in ((r0, 0), (r1, 1)):
        assert out["module"] is not None and out["module"][0] == "ValueError", out
        assert "model.state_dict()" in out["module"][1] and out["module_kept"], out
        assert out["same"] is not None and out["same"][0] == "ValueError" and "'epoch'" in out["same"][1], out
        assert out["same_w"] == [float(rank)] * 2  # nothing overwritten
        assert out["one"] is not None and out["one"][0] == "ValueError" and "'b'" in out["one"][1], out
        assert out["one_a"] == [float(rank)] * 2
    assert "rank 1" in r0["one"][1], r0
