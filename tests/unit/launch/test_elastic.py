"""rt.elastic.Resumable in a 1-process world: cadence, exact resume, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ringtrain import elastic
from ringtrain.errors import ConfigError


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
