"""rt.elastic.Resumable in a 1-process world: cadence, exact resume, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ringtrain import elastic
from ringtrain.errors import CheckpointError, ConfigError


class Counter:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _train(directory: Path, steps: int, stop_at: int | None = None) -> tuple[nn.Module, Counter]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = Counter()
    state = elastic.Resumable(directory, model=model, optimizer=opt, loader=loader, every=5,
                              extra={"epoch": 0})
    for step in range(state.resume(), steps):
        if step == stop_at:
            break  # "killed" here: whatever was not checkpointed is lost
        g = torch.Generator().manual_seed(loader.position)
        loader.position += 1
        x = torch.randn(3, 4, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()  # dropout draws from the global RNG
        opt.step()
        state.extra["epoch"] = step // 10
        state.step_done(step + 1)
    return model, loader


def test_resume_after_an_interruption_is_bit_identical(tmp_path: Path) -> None:
    straight, _ = _train(tmp_path / "a", 23)
    _train(tmp_path / "b", 23, stop_at=13)  # checkpoints at 5 and 10 exist
    resumed, loader = _train(tmp_path / "b", 23)
    assert loader.position == 23
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_checkpoints_every_n_steps_keeping_the_newest(tmp_path: Path) -> None:
    _train(tmp_path, 23)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000015.ckpt", "step-000000020.ckpt"]


def test_resume_reports_step_and_extra(tmp_path: Path) -> None:
    _train(tmp_path, 12)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    state = elastic.Resumable(tmp_path, model=model, every=5)
    assert state.resume() == 10
    assert state.extra == {"epoch": 0} and state.resumed_from == tmp_path / "step-000000010.ckpt"


def test_fresh_start_is_step_zero(tmp_path: Path) -> None:
    state = elastic.Resumable(tmp_path / "none", model=nn.Linear(2, 2))
    assert state.resume() == 0 and state.resumed_from is None
    assert elastic.attempt() == 0


@pytest.mark.parametrize("kw", [{"every": 0}, {"keep": 0}])
def test_bad_arguments(tmp_path: Path, kw: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        elastic.Resumable(tmp_path, model=nn.Linear(2, 2), **kw)  # type: ignore[arg-type]


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 22  # 11 batches of 2: gradient accumulation over 2 crosses the epoch's end

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x + 0.1 * torch.randn(4), torch.tensor([float(i % 3)])  # an augmentation


def _train_amp(directory: Path, steps: int, stop_at: int | None = None) -> dict[str, object]:
    """The usual loop: rt.warmup, GradScaler, 2 accumulated passes, a shuffling Loader with
    workers, dropout; Resumable holds the scheduler and the scaler too."""
    import ringtrain as rt

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = rt.warmup(opt, 10, start_factor=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    loader = rt.data.Loader(Samples(), batch_size=2, shuffle=True, seed=3, num_workers=2, device="cpu")
    state = elastic.Resumable(directory, model=model, optimizer=opt, loader=loader, scheduler=sched,
                              scaler=scaler, every=3)

    def batches() -> object:
        while True:
            loader.set_epoch(loader.state_dict()["epoch"])
            yield from loader

    it = iter(batches())  # type: ignore[call-overload]
    lrs, scales = [], []
    try:
        for step in range(state.resume(), steps):
            if step == stop_at:
                break  # "killed": whatever was not checkpointed is lost
            opt.zero_grad()
            for _ in range(2):
                x, y = next(it)
                scaler.scale((model(x) - y).pow(2).mean() / 2).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            scales.append(scaler.get_scale())
            state.step_done(step + 1)
    finally:
        loader.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "lrs": lrs, "scales": scales,
            "start": state.start_step}


@pytest.mark.timeout(120)
def test_scheduler_and_scaler_resume_exactly(tmp_path: Path) -> None:
    # Before: Resumable had no scheduler= or scaler=, and the documented loop resumed with
    # the warm-up restarted from its first step and the loss scale from its initial value,
    # silently (the parameters then left the uninterrupted run's).
    straight = _train_amp(tmp_path / "a", 14)
    _train_amp(tmp_path / "b", 14, stop_at=8)  # checkpoints at 3 and 6
    resumed = _train_amp(tmp_path / "b", 14)
    assert resumed["start"] == 6
    assert resumed["lrs"] == straight["lrs"][6:] and resumed["scales"] == straight["scales"][6:]
    assert all(torch.equal(a, b) for a, b in zip(straight["params"], resumed["params"], strict=True))  # type: ignore[call-overload]


def test_a_checkpoint_saved_without_the_scheduler_is_refused(tmp_path: Path) -> None:
    _train(tmp_path, 6)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    state = elastic.Resumable(tmp_path, model=model, optimizer=opt, scheduler=sched)
    with pytest.raises(CheckpointError, match="holds no scheduler state"):
        state.resume()


def test_step_done_refuses_a_zero_based_step(tmp_path: Path) -> None:
    # Before: step_done(step) in `for step in range(state.resume(), n)` saved "step-5" with
    # 6 steps done, so every resume trained one step twice, silently.
    _train(tmp_path, 6)  # a checkpoint at 5
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    state = elastic.Resumable(tmp_path, model=model, every=5)
    start = state.resume()
    with pytest.raises(ConfigError, match=r"step_done\(5\) after 5 steps were done: .*step_done\(step \+ 1\)"):
        state.step_done(start)
    assert state.step_done(start + 1) is False and state.step_done(start + 2) is False
    with pytest.raises(ConfigError, match="number of steps completed"):
        state.step_done(start + 2)  # again
    fresh = elastic.Resumable(tmp_path / "fresh", model=model, every=5)
    fresh.resume()
    with pytest.raises(ConfigError):
        fresh.step_done(0)
    assert not (tmp_path / "fresh").exists()


def _train_numpy(directory: Path, steps: int, stop_at: int | None = None) -> nn.Module:
    import numpy as np

    torch.manual_seed(0)
    np.random.seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.Resumable(directory, model=model, optimizer=opt, every=5)
    for step in range(state.resume(), steps):
        if step == stop_at:
            break
        x = torch.from_numpy(np.random.rand(3, 4)).float()  # augmentation in the training process
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        state.step_done(step + 1)
    return model


def test_numpy_random_state_is_restored(tmp_path: Path) -> None:
    # Before: only torch's and Python's generators were saved; numpy's started over in
    # the new process, so the resumed steps drew the first run's numbers again.
    straight = _train_numpy(tmp_path / "a", 12)
    _train_numpy(tmp_path / "b", 12, stop_at=8)
    resumed = _train_numpy(tmp_path / "b", 12)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))


def test_run_in_a_fixed_size_job_saves_every_n_steps(tmp_path: Path) -> None:
    # Before: only a resizable job's commit moved state.step, so docs/launch.md's loop,
    # state.step_done(state.step + 1), passed 1 at every step and never saved a checkpoint
    # (a restart began again from step 0, silently).
    state = elastic.Resumable(tmp_path, model=nn.Linear(2, 1), every=2)

    @elastic.run
    def train(state: elastic.Resumable) -> None:
        for _ in range(7):
            state.step_done(state.step + 1)

    import ringtrain as rt

    initialized = rt.is_initialized()
    try:
        train(state)  # rt.elastic.run calls rt.init(): a 1-process world here
    finally:
        if not initialized:
            rt.shutdown()
    assert state.step == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000004.ckpt", "step-000000006.ckpt"]


def test_saving_in_the_middle_of_a_gradient_accumulation_is_refused(tmp_path: Path) -> None:
    # Before: the checkpoint held no accumulated gradients, so a resume from it took that
    # update with fewer backward passes, silently (step_done counted backward passes).
    import ringtrain as rt

    rt.init()
    try:
        model = nn.Linear(4, 1)
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), backward_passes_per_step=2)
        state = elastic.Resumable(tmp_path, model=model, optimizer=opt, every=1)
        state.resume()
        model(torch.randn(2, 4)).sum().backward()  # 1 of 2 passes
        assert opt.pending_passes == 1
        with pytest.raises(ConfigError, match=r"middle of a gradient accumulation \(1 of 2 backward passes"):
            state.step_done(1)
        assert not list(tmp_path.glob("*.ckpt"))
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert opt.pending_passes == 0
        assert state.step_done(2) is True  # after the optimizer step it saves
    finally:
        rt.shutdown()
