"""`ringtrain doctor --steps S` stops a model-parallel job after the same step on every
rank: Parallel.update is one of the loop's stop checks (a pipeline's later stages read
no batches, so the loader's check never runs there)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ringtrain import events
from ringtrain.parallel import parallelize


def test_update_leaves_when_the_doctor_asked() -> None:
    torch.manual_seed(0)
    par = parallelize(nn.Sequential(nn.Linear(4, 2)), nn.functional.mse_loss)
    opt = torch.optim.SGD(par.parameters(), lr=0.1)
    par.step(torch.randn(3, 4), torch.randn(3, 2))
    events.request_stop()
    try:
        with pytest.raises(SystemExit) as info:
            par.update(opt)
        assert info.value.code == 0
    finally:
        events._stop_requested = False
