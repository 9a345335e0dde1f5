"""On two real Gloo ranks: with gradient accumulation a metered step is one optimizer
update of k batches, whoever exchanges the gradients (ringtrain's optimizer with
``backward_passes_per_step``, Horovod's, or torch DDP with ``no_sync()``).

Every batch sleeps ``DATA_S`` in its collate function: a sleep lasts at least that long
on any load, so the per-update data wait is checked against its lower bound only.
"""

from __future__ import annotations

from typing import Any

from ringtest import hvd_scenarios, run_world, scenario_results

K = 4
DATA_S = 0.005
BATCHES = 8  # per rank and epoch: 2 updates
EPOCHS = 2


def _dataset() -> Any:
    import torch

    return torch.utils.data.TensorDataset(torch.randn(2 * BATCHES * 4, 6), torch.randn(2 * BATCHES * 4, 1))


def _collate(batch: Any) -> Any:
    import time

    import torch

    time.sleep(DATA_S)
    return torch.utils.data.default_collate(batch)


def _train(kind: str, hvd: Any = None) -> dict[str, Any]:
    import contextlib

    import torch

    import ringtrain as rt
    from ringtrain import observe

    observe.start(progress=False, warmup=0, gpu=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.01)
    net: Any = model
    if kind == "rt":
        opt = rt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      backward_passes_per_step=K)
    elif kind == "hvd":
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       backward_passes_per_step=K)
    else:  # torch DDP, accumulating under no_sync(): only the hook on torch optimizers sees updates
        net = torch.nn.parallel.DistributedDataParallel(model)
    if kind == "ddp":
        sampler = torch.utils.data.distributed.DistributedSampler(_dataset(), shuffle=False)
        loader: Any = observe.instrument(torch.utils.data.DataLoader(
            _dataset(), batch_size=4, sampler=sampler, collate_fn=_collate))
    else:
        loader = rt.data.Loader(_dataset(), batch_size=4, shuffle=False, num_workers=0,
                                collate_fn=_collate)
    n = 0
    for epoch in range(EPOCHS):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        for x, y in loader:
            n += 1
            quiet = net.no_sync() if kind == "ddp" and n % K else contextlib.nullcontext()
            with quiet:
                (torch.nn.functional.mse_loss(net(x), y) / K).backward()
            if n % K == 0:
                opt.step()
                opt.zero_grad()
    s = observe.summary("all")
    observe.stop()
    return {"batches": n, "steps": s["steps"], "batches_per_step": s.get("batches_per_step"),
            "buckets_per_step": s["exchange"]["buckets_per_step"],
            "data_wait_s": s["phases_s"]["data_wait"], "step_s": s["step_s"]["mean"],
            "samples_per_step": (s["samples_per_s"] or 0.0) * s["step_s"]["mean"]}


def _rank() -> dict[str, Any]:
    out = {"rt": _train("rt"), "ddp": _train("ddp")}
    out.update(hvd_scenarios(lambda hvd: [("hvd", lambda: _train("hvd", hvd))]))
    return out


def test_an_accumulating_update_is_one_metered_step() -> None:
    world = run_world(_rank, 2, timeout=90)
    for kind in ("rt", "hvd", "ddp"):
        for rank, r in enumerate(scenario_results(world, kind)):
            where = (kind, rank, r)
            assert r["batches"] == EPOCHS * BATCHES, where
            # One step per update, not k-1 short steps before the first one (or one per batch).
            assert r["steps"] == EPOCHS * BATCHES // K, where
            assert r["batches_per_step"] == K, where
            assert abs(r["samples_per_step"] - 4 * K) < 1e-6, where
            # Each update waited for its k batches' sleeps.
            assert r["data_wait_s"] >= K * DATA_S, where
            assert r["step_s"] >= r["data_wait_s"], where
            # ringtrain's optimizers exchange once per update; DDP's exchange is not metered.
            assert r["buckets_per_step"] == (0.0 if kind == "ddp" else 1.0), where
