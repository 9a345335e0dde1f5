"""Synthetic compute-bound training: batches are ready at once, the device step takes 30 ms."""

from __future__ import annotations

import time

import torch

import ringtrain as rt

rt.init()
model = torch.nn.Linear(16, 4)
opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters())
batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(10_000)]
for x, y in rt.observe.instrument(batches):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    time.sleep(0.030)  # the device step
    opt.step()
