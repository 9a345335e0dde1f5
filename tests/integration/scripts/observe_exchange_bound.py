"""Synthetic exchange-bound training: 16 MB of gradients per step for a few ms of compute.

Run with 2 ranks: one 2048x2048 layer and a batch of 4, so each step's allreduce
(tens of ms for 16 MB over Gloo loopback on 2 cores; docs/sync.md has this machine's
numbers) dwarfs forward and backward.
"""

from __future__ import annotations

import torch

import ringtrain as rt

rt.init()
torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048, bias=False)
opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                              named_parameters=model.named_parameters())
x, y = torch.randn(4, 2048), torch.randn(4, 2048)
for _ in rt.observe.instrument(range(10_000)):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
