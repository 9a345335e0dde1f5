"""A torchrun + DistributedDataParallel script, as PyTorch's DDP tutorial writes it (before).

    torchrun --nproc-per-node 2 ddp_before.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(42)

g = torch.Generator().manual_seed(0)
x_all = torch.randn(512, 8, generator=g)
y_all = x_all @ torch.linspace(-1, 1, 8) + 0.5
x, y = x_all[rank::world], y_all[rank::world]

model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * world, momentum=0.9)

for epoch in range(5):
    for start in range(0, len(x), 32):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[start:start + 32]).squeeze(1), y[start:start + 32])
        loss.backward()
        optimizer.step()
    avg = loss.detach().clone()
    dist.all_reduce(avg)
    if rank == 0:
        print(f"epoch {epoch} loss {avg.item() / world:.4f}", flush=True)
        torch.save(model.module.state_dict(), os.environ.get("OUT", "checkpoint.pt"))
# Every rank waits for rank 0's checkpoint: torchrun stops the job when the first rank
# exits with an error, which would cut the save short.
dist.barrier()
dist.destroy_process_group()
