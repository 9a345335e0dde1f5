"""Measured training-state bytes: the storages parameters, gradients and Adam hold."""

from __future__ import annotations

import torch
from torch import nn

from ringtrain.parallel.memory import state_memory


def test_adam_state_is_sixteen_bytes_per_parameter_plus_step_counters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 3))
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    before = state_memory(model.parameters(), opt)
    assert (before.parameters, before.gradients, before.optimizer) == (4 * n, 0, 0)
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    after = state_memory(model.parameters(), opt)
    assert after.gradients == 4 * n
    steps = 4 * len(list(model.parameters()))  # one float32 step counter per tensor
    assert after.optimizer == 8 * n + steps
    assert after.total == 16 * n + steps and after.mib == after.total / 2**20


def test_a_storage_shared_by_several_tensors_counts_once() -> None:
    flat = torch.zeros(30)
    a, b = nn.Parameter(flat[:10]), nn.Parameter(flat[10:])
    assert state_memory([a, b]).parameters == 30 * 4
