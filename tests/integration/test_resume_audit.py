"""rt.elastic.Resumable on 2 real Gloo ranks, the usual loop: a warm-up schedule, a
GradScaler, gradient accumulation, a shuffling rt.data.Loader and dropout, through
rt.DistributedOptimizer and rt.LocalSGD. Killed mid-epoch and resumed, the run goes on
as the uninterrupted one did: the same batches, rates and loss scales, and bit-identical
parameters on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ringtest import run_world
from torch import nn

STEPS, STOP, EVERY = 12, 8, 3  # killed at step 8: the newest checkpoint is step 6's


class _Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 40  # 10 batches of 2 per rank: accumulation over 2 passes crosses epochs

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, torch.tensor([float(i)])


def _train(directory: str, kind: str, stop: int | None) -> dict[str, Any]:
    import ringtrain as rt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt: Any
    if kind == "dist":
        opt = rt.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                      backward_passes_per_step=2)
        sched = rt.warmup(opt, 10)
    else:
        opt = rt.LocalSGD(model, inner, sync_every=4)
        sched = rt.warmup(inner, 10)  # schedules act on the inner optimizer (docs/lowcomm.md)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    loader = rt.data.Loader(_Samples(), batch_size=2, shuffle=True, seed=5, num_workers=0, device="cpu")
    state = rt.elastic.Resumable(directory, model=model, optimizer=opt, loader=loader,
                                 scheduler=sched, scaler=scaler, every=EVERY)

    def batches() -> Any:
        while True:
            loader.set_epoch(loader.state_dict()["epoch"])
            yield from loader

    it = batches()
    seen: list[list[float]] = []
    rates: list[tuple[float, float]] = []
    for step in range(state.resume(), STEPS):
        if step == stop:
            break  # "killed": whatever was not checkpointed is lost
        opt.zero_grad()
        for _ in range(2):
            x, y = next(it)
            seen.append(y.view(-1).tolist())
            x = x + 0.1 * torch.randn_like(x)  # an augmentation drawn in the training process
            scaler.scale((model(x) - y / 40).pow(2).mean() / 2).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        rates.append((opt.param_groups[0]["lr"], scaler.get_scale()))
        state.step_done(step + 1)
    return {"params": [p.detach().clone() for p in model.parameters()], "seen": seen,
            "rates": rates, "start": state.start_step}


def _world(directory: str) -> dict[str, Any]:
    out = {}
    for kind in ("dist", "localsgd"):
        straight = _train(f"{directory}/{kind}-a", kind, None)
        _train(f"{directory}/{kind}-b", kind, STOP)
        out[kind] = (straight, _train(f"{directory}/{kind}-b", kind, None))
    return out


@pytest.mark.timeout(180)
def test_a_resumed_run_goes_on_exactly(tmp_path: Any) -> None:
    # Before: Resumable had no scheduler= / scaler=; the documented loop resumed with the
    # warm-up restarted and the loss scale reset, silently, and the parameters diverged.
    results = run_world(_world, 2, str(tmp_path), timeout=170)
    for rank, by_kind in enumerate(results):
        for kind, (straight, resumed) in by_kind.items():
            k = resumed["start"]
            assert k == 6, (rank, kind)
            assert resumed["seen"] == straight["seen"][2 * k:], (rank, kind, "batches")
            assert resumed["rates"] == straight["rates"][k:], (rank, kind, "rate or scale")
            assert all(torch.equal(a, b) for a, b in zip(straight["params"], resumed["params"], strict=True)), \
                (rank, kind, "parameters")
