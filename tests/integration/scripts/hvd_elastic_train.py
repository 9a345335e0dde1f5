"""An elastic Horovod-style script (written against horovod.torch's API): killed once,
restarted by the launcher, it resumes from its last commit.

``python hvd_elastic_train.py OUT KILL_AT``: rank 1 SIGKILLs itself at global batch
KILL_AT of the first attempt. Rank 0 writes, per epoch, the sorted sample ids processed
by all ranks, and the final weights, to OUT (a torch file).
"""

import os
import signal
import sys

import torch

import ringtrain.horovod as hvd

out, kill_at = sys.argv[1], int(sys.argv[2])
hvd.init()
torch.manual_seed(0)
data = torch.randn(96, 5)
target = data @ torch.arange(5.0) + 1.0
dataset = torch.utils.data.TensorDataset(torch.arange(96), data, target)
model = torch.nn.Linear(5, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=1)
resets = []
state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0, seen={}, step=0)
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


@hvd.elastic.run
def train(state):
    while state.epoch < 3:
        sampler.set_epoch(state.epoch) if state.batch == 0 else None
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
        for i, (ids, x, y) in enumerate(loader):
            if os.environ.get("RINGTRAIN_ATTEMPT") == "0" and hvd.rank() == 1 and state.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            got = hvd.allgather(ids)
            state.seen.setdefault(state.epoch, []).extend(got.tolist())
            sampler.record_batch(i, 4)
            state.batch += 1
            state.step += 1
            state.commit()
        state.epoch += 1
        state.batch = 0
        state.commit()


train(state)
if hvd.rank() == 0:
    torch.save({"seen": state.seen, "weight": model.weight.detach(), "resets": resets,
                "attempt": os.environ.get("RINGTRAIN_ATTEMPT")}, out)
hvd.shutdown()
