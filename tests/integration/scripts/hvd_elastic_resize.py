"""A Horovod elastic script (written against horovod.torch's API) for resize tests: the
seed CNN (examples/mnist_cnn.py) on the bundled digits.

``python hvd_elastic_resize.py OUT [--epochs E] [--batch-size B] [--lr L]``

The learning rate follows the world's size (a reset callback, as Horovod users write
it); an ``ElasticSampler`` gives each rank its share of what is left of the epoch.
Samples the sampler adds to even out the ranks (padding) are masked out of the loss, so
"processed" means trained on exactly once. Whoever is rank 0 appends one JSON line per
event to ``OUT.events`` (``start``, ``reset``, ``step``) with the wall-clock time, and at
the end writes ``OUT`` with the test accuracy, every epoch's processed sample ids (all
ranks', gathered each step and committed with the state) and the sizes it ran at.
``RESIZE_KILL=RANK:STEP`` makes that rank of the first world SIGKILL itself before that
step (a lost worker without a lost host).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ringtrain.horovod as hvd
from ringtrain.elastic import world_version

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from mnist_cnn import MnistCNN, evaluate, load_digits_28x28  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.5, help="Adadelta rate per rank (times size)")
parser.add_argument("--seed", type=int, default=42)
args = parser.parse_args()
events = Path(args.out + ".events")
kill_rank, _, kill_step = os.environ.get("RESIZE_KILL", "-1:-1").partition(":")


def event(kind: str, **fields: object) -> None:
    if hvd.rank() == 0:
        with events.open("a") as f:
            f.write(json.dumps({"event": kind, "time": time.time(), "size": hvd.size(),
                                "world": world_version(), **fields}) + "\n")


class Indexed(torch.utils.data.Dataset):
    def __init__(self, base: torch.utils.data.TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x, y = self.base[i]
        return i, x, y


hvd.init()
torch.manual_seed(args.seed)
train_set, test_set = load_digits_28x28()
dataset = Indexed(train_set)
model = MnistCNN()
opt = hvd.DistributedOptimizer(torch.optim.Adadelta(model.parameters(), lr=args.lr * hvd.size()),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0, step=0, seen={}, sizes=[])


def set_lr(epoch: int) -> None:
    # Linear scaling rule: the rate follows the size; a tenth of it for the last quarter
    # of the epochs, so the final accuracy is that of a settled model, not of the last
    # few noisy steps (two runs are compared within 1 point).
    decay = 0.1 if epoch >= args.epochs * 3 // 4 else 1.0
    for group in opt.param_groups:
        group["lr"] = args.lr * hvd.size() * decay


def on_reset() -> None:
    set_lr(state.epoch)
    event("reset", lr=opt.param_groups[0]["lr"])


state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    event("start", step=state.step, epoch=state.epoch, lr=opt.param_groups[0]["lr"])
    state.sizes.append(hvd.size())
    while state.epoch < args.epochs:
        if state.batch == 0:
            sampler.set_epoch(state.epoch)
            set_lr(state.epoch)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        left = len(sampler.remaining_indices)
        for i, (ids, x, y) in enumerate(loader):
            if (world_version() == 0 and hvd.rank() == int(kill_rank)
                    and state.step == int(kill_step)):
                os.kill(os.getpid(), signal.SIGKILL)
            # Global position of each sample in what is left of the epoch; past the end
            # is padding (the sampler repeats samples so every rank has as many).
            pos = torch.arange(i * args.batch_size, i * args.batch_size + len(ids)) * sampler.num_replicas
            real = (pos + sampler.rank) < left
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y, reduction="none")
            (loss * real).sum().div(max(1, int(real.sum()))).backward()
            opt.step()
            got = hvd.allgather(ids[real], name="ids")
            state.seen.setdefault(state.epoch, []).extend(got.tolist())
            sampler.record_batch(i, args.batch_size)
            state.batch += 1
            state.step += 1
            event("step", step=state.step, epoch=state.epoch, loss=float(loss.detach().mean()))
            state.commit()
        state.epoch += 1
        state.batch = 0
        state.commit()


train(state)
if hvd.rank() == 0:
    accuracy = evaluate(model, test_set, torch.device("cpu"))
    result = {"accuracy": accuracy, "seen": {str(k): v for k, v in state.seen.items()},
              "samples": len(dataset), "sizes": state.sizes, "steps": state.step}
    Path(args.out).write_text(json.dumps(result))
    print(f"done: accuracy {accuracy:.4f} after {state.step} steps at sizes {state.sizes}", flush=True)
hvd.shutdown()
