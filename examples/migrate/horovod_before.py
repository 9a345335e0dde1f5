"""A Horovod PyTorch training script, as Horovod's documentation teaches it (before)."""

import torch
import torch.nn.functional as F

import horovod.torch as hvd

hvd.init()
torch.manual_seed(42)
if torch.cuda.is_available():
    torch.cuda.set_device(hvd.local_rank())

# Every rank reads its own shard of a synthetic regression problem.
g = torch.Generator().manual_seed(0)
x_all = torch.randn(512, 8, generator=g)
y_all = x_all @ torch.linspace(-1, 1, 8) + 0.5
x, y = x_all[hvd.rank()::hvd.size()], y_all[hvd.rank()::hvd.size()]

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.none, op=hvd.Average)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for epoch in range(5):
    for start in range(0, len(x), 32):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[start:start + 32]).squeeze(1), y[start:start + 32])
        loss.backward()
        optimizer.step()
    avg = hvd.allreduce(loss.detach(), name="avg_loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch} loss {avg.item():.4f}", flush=True)
        torch.save(model.state_dict(), "checkpoint.pt")  # rank 0 only
