"""A job whose rank 1 stops at its second step in attempt 0 (a hung data source).

``python stall_job.py STRATEGY [stop]``: ``stop`` SIGSTOPs rank 1 instead of sleeping. Prints ``done`` on every rank when it finishes.
"""

import os
import signal
import sys
import time

import torch

import ringtrain as rt

rt.init()
model = torch.nn.Linear(4, 2)
opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters(), strategy=sys.argv[1])
for step in range(3):
    if step == 1 and rt.rank() == 1 and os.environ.get("RINGTRAIN_ATTEMPT", "0") == "0":
        # after a first step: the exchanges now run on Gloo, not the store
        if sys.argv[2:] == ["stop"]:
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped (kill -STOP): not even its threads run
        time.sleep(600)
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
print("done", flush=True)
