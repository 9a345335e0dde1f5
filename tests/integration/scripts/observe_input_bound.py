"""Synthetic input-bound training: a batch takes 30 ms to make, the device step 10 ms."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

import ringtrain as rt


def slow_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for _ in range(10_000):
        time.sleep(0.030)  # preprocessing in the training loop
        yield torch.randn(8, 16), torch.randn(8, 4)


rt.init()
model = torch.nn.Linear(16, 4)
opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters())
for x, y in rt.observe.instrument(slow_batches()):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    time.sleep(0.010)  # the device step
    opt.step()
