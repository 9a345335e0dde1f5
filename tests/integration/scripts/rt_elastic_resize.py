"""A ringtrain-native resizable script: ``rt.elastic.run`` with a ``Resumable`` over a
model, a ``DistributedOptimizer`` and an ``rt.data.Loader``.

``python rt_elastic_resize.py OUT CKPT_DIR [--epochs E] [--sharded]``; ``RESIZE_KILL=RANK:STEP``
makes that rank of the first world SIGKILL itself before that step. 96 samples in
batches of 4: with 3 or 2 ranks the rest of an epoch is never padded, so every sample
of every epoch must be trained on exactly once. Rank 0 writes OUT (JSON): each epoch's
processed ids (gathered every step, committed with the state), the sizes it ran at and
the learning rates the reset callback set. ``--sharded`` reads the same samples as a
sharded dataset (7 uneven shards), so the loader splits shards across ranks and the rest
of an epoch is re-cut for the smaller world (a new stage, see ShardPlan). ``--diloco H``
trains with rt.DiLoCo syncing every H steps instead of DistributedOptimizer; at the end
every rank syncs once more and OUT also holds each rank's parameter digest.
``RESIZE_GROW=STEP:FLAG``: rank 0 of the first world creates the file FLAG before that
step (the test's discovery script then lists one more slot), and every step sleeps
0.1 s so the job lasts until the larger world has formed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch

import ringtrain as rt
from ringtrain import elastic

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("ckpt")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--sharded", action="store_true")
parser.add_argument("--diloco", type=int, help="rt.DiLoCo with this sync_every")
args = parser.parse_args()
kill_rank, _, kill_step = os.environ.get("RESIZE_KILL", "-1:-1").partition(":")
grow_step, _, grow_flag = os.environ.get("RESIZE_GROW", "-1:").partition(":")
BASE_LR = 0.02

rt.init()
torch.manual_seed(0)
data = torch.randn(96, 5)
target = data @ torch.arange(5.0) + 1.0
dataset = torch.utils.data.TensorDataset(torch.arange(96), data, target)
if args.sharded:
    bounds = [0, 20, 23, 41, 60, 64, 83, 96]
    dataset = rt.data.StreamShards([range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)],
                                   lambda ids: ((i, data[i], target[i]) for i in ids))
model = torch.nn.Linear(5, 1)
if args.diloco:
    opt = rt.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=BASE_LR * rt.size()),
                    torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True),
                    sync_every=args.diloco)
else:
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=BASE_LR * rt.size()),
                                  named_parameters=model.named_parameters())
loader = rt.data.Loader(dataset, batch_size=4, shuffle=True, seed=1, num_workers=0)
state = elastic.Resumable(args.ckpt, model=model, optimizer=opt, loader=loader, every=1000,
                          extra={"seen": {}, "sizes": [], "lrs": []})


def on_reset() -> None:
    for group in opt.param_groups:
        group["lr"] = BASE_LR * rt.size()
    state.extra["lrs"].append(opt.param_groups[0]["lr"])


state.register_reset_callbacks([on_reset])


@elastic.run
def train(state: elastic.Resumable) -> None:
    state.extra["sizes"].append(rt.size())
    while (epoch := loader.state_dict()["epoch"]) < args.epochs:
        loader.set_epoch(epoch)
        for ids, x, y in loader:
            if elastic.world_version() == 0 and rt.rank() == int(kill_rank) and state.step == int(kill_step):
                os.kill(os.getpid(), signal.SIGKILL)
            if grow_flag:
                if elastic.world_version() == 0 and rt.rank() == 0 and state.step == int(grow_step):
                    Path(grow_flag).touch()
                time.sleep(0.1)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x).squeeze(1), y).backward()
            opt.step()
            state.extra["seen"].setdefault(epoch, []).extend(rt.allgather(ids).tolist())
            state.step_done(state.step + 1)


train(state)
digests = []
if args.diloco:
    opt.sync()  # one model on every rank
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digests = rt.allgather_object(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
if rt.rank() == 0:
    Path(args.out).write_text(json.dumps({"seen": {str(k): v for k, v in state.extra["seen"].items()},
                                          "sizes": state.extra["sizes"], "lrs": state.extra["lrs"],
                                          "steps": state.step, "size": rt.size(), "digests": digests,
                                          "syncs": getattr(opt, "syncs", None)}))
rt.shutdown()
