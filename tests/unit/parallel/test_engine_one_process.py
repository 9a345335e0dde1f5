"""parallelize() with everything off in one process: the plain training loop, exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ringtrain.errors import CheckpointError, ConfigError
from ringtrain.parallel import parallelize


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def test_one_process_is_the_plain_loop_bit_for_bit() -> None:
    plain = _model()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    par = parallelize(_model(), nn.functional.mse_loss)
    popt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    for step in range(5):
        x, y = _data(step)
        loss = nn.functional.mse_loss(plain(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert par.step(x, y, optimizer=popt) == loss.item()
    assert par.module is not None and par.reads_data and par.is_last_stage
    assert (par.data_rank, par.data_size) == (0, 1)
    full = par.full_parameters()
    assert all(torch.equal(full[k], v) for k, v in plain.state_dict().items())


def test_a_step_without_data_is_an_error_naming_the_rule() -> None:
    par = parallelize(_model(), nn.functional.mse_loss)
    with pytest.raises(ConfigError, match="every rank reads its data shard"):
        par.step()


def test_degrees_beyond_one_process_are_refused() -> None:
    with pytest.raises(ConfigError, match="world size 1"):
        parallelize(_model(), nn.functional.mse_loss, pipeline=2)
    with pytest.raises(ConfigError, match="world size 1"):
        parallelize(_model(), nn.functional.mse_loss, tensor=2)


def test_tensor_parallel_needs_a_plan() -> None:
    from ringtrain.parallel.engine import _check
    from ringtrain.parallel.layout import Layout

    with pytest.raises(ConfigError, match="tensor=2 needs tensor_plan="):
        _check(_model(), Layout(tensor=2).resolve(2), "params", None)


def test_save_and_load_round_trip_model_and_optimizer(tmp_path: Path) -> None:
    par = parallelize(_model(), nn.functional.mse_loss)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    for step in range(3):
        par.step(*_data(step), optimizer=opt)
    par.save(str(tmp_path / "a.dcp"), opt)
    torch.manual_seed(5)
    other = parallelize(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)),
                        nn.functional.mse_loss)
    oopt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other.load(str(tmp_path / "a.dcp"), oopt)
    a, b = par.full_parameters(), other.full_parameters()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The optimizer's moments came along: the next steps agree exactly.
    assert par.step(*_data(9), optimizer=opt) == other.step(*_data(9), optimizer=oopt)


@pytest.mark.parametrize(("save_opt", "other", "with_opt", "word"), [
    (False, _model, True, r"no optimizer state.*par\.load\(path\) and no optimizer"),
    (True, lambda: nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 2)), False,
     r"Size mismatch.*another model"),
])
def test_a_checkpoint_that_does_not_fit_is_a_one_line_error(
        tmp_path: Path, save_opt: bool, other: Any, with_opt: bool, word: str) -> None:
    # Before: DCP's CheckpointException, a BaseException (`except Exception` misses it)
    # whose text is a torch traceback per rank.
    par = parallelize(_model(), nn.functional.mse_loss)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    par.step(*_data(0), optimizer=opt)
    par.save(str(tmp_path / "a.dcp"), opt if save_opt else None)
    target = parallelize(other(), nn.functional.mse_loss)
    topt = torch.optim.AdamW(target.parameters(), lr=1e-2) if with_opt else None
    with pytest.raises(CheckpointError, match=word) as info:
        target.load(str(tmp_path / "a.dcp"), topt)
    assert "\n" not in str(info.value)
