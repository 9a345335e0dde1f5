"""Resumable.save and resume with rt.LocalSGD on 2 Gloo ranks: only rank 0, which writes
the file, receives the ranks' local states (parameters and momentum between syncs);
rank 1 sends its own and receives none of rank 0's. On resume rank 0 reads the file and
rank 1 receives the shared state and its own local state, not rank 0's (a broadcast of
the file would put N copies of the model's local state in each rank's memory). The file
is the one the allgather wrote, byte for byte, a resume from it is exact, and a state
that cannot be pickled is the same one-line error on both ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ringtest import run_world
from torch import nn

WIDTH = 128  # 16.5k parameters: ~130 KB of local state per rank (params + momentum)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _build(seed: int) -> tuple[nn.Module, Any]:
    import ringtrain as rt

    torch.manual_seed(seed)
    model = nn.Linear(WIDTH, WIDTH)
    return model, rt.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), sync_every=100)


def _train(model: nn.Module, opt: Any, steps: range, rank: int) -> None:
    for step in steps:
        opt.zero_grad()
        x = _batch(step, rank) + 0.01 * torch.randn(4, WIDTH)  # noise from the restored RNG
        model(x).pow(2).mean().backward()
        opt.step()


def _received_while(call: Any) -> tuple[Any, int]:
    """``call()``'s result and the bytes this rank received from others in gathers,
    scatters and broadcasts meanwhile (what they put in memory here)."""
    import torch.distributed as dist

    got = [0]
    real_all_gather, real_gather, real_broadcast = dist.all_gather, dist.gather, dist.broadcast
    real_scatter = dist.scatter

    def all_gather(outs: list[torch.Tensor], t: torch.Tensor, *a: Any, **k: Any) -> Any:
        got[0] += sum(o.numel() * o.element_size() for o in outs) - t.numel() * t.element_size()
        return real_all_gather(outs, t, *a, **k)

    def gather(t: torch.Tensor, gather_list: list[torch.Tensor] | None = None, *a: Any, **k: Any) -> Any:
        if gather_list:
            got[0] += sum(o.numel() * o.element_size() for o in gather_list) - t.numel() * t.element_size()
        return real_gather(t, gather_list, *a, **k)

    def broadcast(t: torch.Tensor, src: int, *a: Any, **k: Any) -> Any:
        if dist.get_rank() != src:
            got[0] += t.numel() * t.element_size()
        return real_broadcast(t, src, *a, **k)

    def scatter(t: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, *a: Any, **k: Any) -> Any:
        if not scatter_list:
            got[0] += t.numel() * t.element_size()
        return real_scatter(t, scatter_list, *a, **k)

    dist.all_gather, dist.gather, dist.broadcast, dist.scatter = all_gather, gather, broadcast, scatter
    try:
        return call(), got[0]
    finally:
        dist.all_gather, dist.gather, dist.broadcast = real_all_gather, real_gather, real_broadcast
        dist.scatter = real_scatter


def _world(directory: str) -> dict[str, Any]:
    import ringtrain as rt
    from ringtrain import checkpoint, collectives
    from ringtrain.elastic.gather import gather_to_root, scatter_from_root
    from ringtrain.elastic.resume import _local_state, _rng_state
    from ringtrain.errors import ConfigError

    rank = rt.rank()
    model, opt = _build(0)
    state = rt.elastic.Resumable(f"{directory}/new", model=model, optimizer=opt, every=1000)
    state.resume()
    _train(model, opt, range(3), rank)
    local = opt.local_state_dict()
    local_bytes = sum(t.numel() * t.element_size() for t in local["params"]) + sum(
        v.numel() * v.element_size() for s in local["inner"]["state"].values() for v in s.values())

    path, received = _received_while(lambda: state.save(3))

    # What the allgather version wrote, from the same state (nothing above moved it).
    mine = {"rng": _rng_state(), "loader": None, "optimizer": _local_state(opt)}
    per_rank = collectives.allgather_object(mine, name="old save")
    same_file = None
    if rank == 0:
        old = checkpoint.save(Path(directory) / "old" / Path(path).name, {
            "step": 3, "model": model.state_dict(), "optimizer": opt.state_dict(), "per_rank": per_rank,
            "scheduler": None, "scaler": None, "extra": {}})
        same_file = Path(path).read_bytes() == Path(old).read_bytes()

    _train(model, opt, range(3, 5), rank)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt = _build(1)  # other weights: the resume must bring back rank's own
    state = rt.elastic.Resumable(f"{directory}/new", model=model, optimizer=opt, every=1000)
    start, resume_received = _received_while(state.resume)
    file_bytes = Path(path if path is not None else checkpoint.latest(f"{directory}/new")).stat().st_size
    _train(model, opt, range(start, 5), rank)
    exact = all(torch.equal(a, b) for a, b in zip(straight, model.parameters(), strict=True))

    # A state rank 1 cannot pickle: the same one line on both ranks, and they stay in step.
    import threading

    try:
        gather_to_root(threading.Lock() if rank == 1 else 1, name="elastic.save")
        error = ""
    except ConfigError as exc:
        error = str(exc)
    try:
        scatter_from_root([1, threading.Lock()] if rank == 0 else None, name="elastic.resume")
        scatter_error = ""
    except ConfigError as exc:
        scatter_error = str(exc)
    return {"received": received, "local_bytes": local_bytes, "saved": path is not None,
            "same_file": same_file, "start": start, "exact": exact, "error": error,
            "resume_received": resume_received, "file_bytes": file_bytes, "scatter_error": scatter_error,
            "after": gather_to_root(rank, name="after"),
            "scattered": scatter_from_root(["a", "b"] if rank == 0 else None, name="after")}


@pytest.mark.timeout(60)
def test_only_rank0_receives_the_local_states_and_resume_stays_exact(tmp_path: Any) -> None:
    root, other = run_world(_world, 2, str(tmp_path), timeout=50)
    assert root["saved"] and not other["saved"]
    assert root["same_file"] is True, "the checkpoint differs from the allgather version's"
    # Rank 0 receives rank 1's state; rank 1 only the sizes and agreement headers (before:
    # rank 0's whole local state too, ~130 KB).
    assert root["received"] >= other["local_bytes"]
    assert other["received"] < other["local_bytes"] / 20, other
    for r in (root, other):
        assert r["start"] == 3 and r["exact"], r
        assert r["error"] == ("gather of 'elastic.save' on rank 1 cannot pickle lock: "
                              "cannot pickle '_thread.lock' object"), r["error"]
    # The resume: rank 1 receives the file less rank 0's local state (the model, the
    # optimizer's shared state and its own local state), where a broadcast sends it all.
    assert other["resume_received"] <= other["file_bytes"] - root["local_bytes"] * 0.8, other
    for r in (root, other):
        assert r["scatter_error"] == ("scatter of 'elastic.resume for rank 1' on rank 0 cannot pickle "
                                      "lock: cannot pickle '_thread.lock' object"), r["scatter_error"]
    assert (root["after"], other["after"]) == ([0, 1], None)
    assert (root["scattered"], other["scattered"]) == ("a", "b")

