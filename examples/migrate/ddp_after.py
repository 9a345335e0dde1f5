"""The same training with ringtrain (after): the launcher's environment, the wrapper
and the collectives change; the model, data and loop do not.

    ringrun -np 2 python ddp_after.py        # (torchrun works too)
"""

import os

import torch
import torch.nn.functional as F

import ringtrain as rt

rt.init()  # replaces init_process_group: reads ringrun's, torchrun's, mpirun's or srun's env
rank, world = rt.rank(), rt.size()
torch.manual_seed(42)

g = torch.Generator().manual_seed(0)
x_all = torch.randn(512, 8, generator=g)
y_all = x_all @ torch.linspace(-1, 1, 8) + 0.5
x, y = x_all[rank::world], y_all[rank::world]

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
rt.broadcast_parameters(model.state_dict(), root_rank=0)  # DDP does this in its constructor
optimizer = torch.optim.SGD(model.parameters(), lr=rt.scale_lr(0.01), momentum=0.9)
optimizer = rt.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

for epoch in range(5):
    for start in range(0, len(x), 32):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[start:start + 32]).squeeze(1), y[start:start + 32])
        loss.backward()
        optimizer.step()
    avg = rt.allreduce(loss.detach(), op=rt.Average, name="avg_loss")
    if rank == 0:
        print(f"epoch {epoch} loss {avg.item():.4f}", flush=True)
        rt.checkpoint.save(os.environ.get("OUT", "checkpoint.ckpt"), model.state_dict())
rt.shutdown()
