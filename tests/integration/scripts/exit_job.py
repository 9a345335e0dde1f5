"""A short job that leaves without rt.shutdown(), as most scripts do; at the very end
of exit (after ringtrain's own exit handler) each rank prints which of ringtrain's
threads still run. argv: STRATEGY.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

import torch

strategy = sys.argv[1]


def report() -> None:
    # Registered before rt.init(): atexit runs it after ringtrain's exit handler.
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("ringtrain-"))
    print(f"rank {os.environ.get('RANK')} threads at exit: {names}", flush=True)


atexit.register(report)

import ringtrain as rt  # noqa: E402 - after the handler above

rt.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), strategy=strategy)
rt.broadcast_parameters(model.state_dict(), root_rank=0)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
rt.allreduce(torch.ones(1))
print(f"done {rt.rank()}", flush=True)
