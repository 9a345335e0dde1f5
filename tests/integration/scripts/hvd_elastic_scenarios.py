"""A Horovod elastic script for horovodrun's elastic scenarios (tests/integration/
test_horovodrun_elastic.py), written against horovod.torch's API: a 2-parameter model,
``hvd.elastic.TorchState`` with epoch and batch, a commit after every batch.

``python hvd_elastic_scenarios.py LOG [--epochs E] [--batches B] [--exit-at SPEC]
[--exit-mode exception|kill] [--wait-for-hosts-after EPOCHS]``

Whoever is rank 0 at the end of an epoch appends one JSON line to LOG: the epoch, the
world's size, the rank this process was started with (``HOROVOD_RANK`` at its start),
its ``HOROVOD_HOSTNAME`` and how many worlds the state has been through (``rendezvous``,
part of the synced state). The discovery script of a test reads LOG's line count to
know the epoch. ``--exit-at "E,B:R1,R2;..."``: at epoch E, batch B, the processes
started as ranks R1, R2 raise (or SIGKILL themselves). ``--wait-for-hosts-after
"E1,E2"``: after logging those epochs every rank waits (up to 120 s) until ringrun has a
new world, so a change of hosts lands at the next commit however slow the machine is.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import ringtrain.elastic as rt_elastic
import ringtrain.horovod as hvd

parser = argparse.ArgumentParser()
parser.add_argument("log")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batches", type=int, default=5)
parser.add_argument("--exit-at", default="")
parser.add_argument("--exit-mode", default="exception", choices=("exception", "kill"))
parser.add_argument("--wait-for-hosts-after", default="")
args = parser.parse_args()

exits: dict[tuple[int, int], list[int]] = {}
for item in filter(None, args.exit_at.split(";")):
    when, ranks = item.split(":")
    e, b = (int(x) for x in when.split(","))
    exits[(e, b)] = [int(r) for r in ranks.split(",")]
wait_after = {int(e) for e in filter(None, args.wait_for_hosts_after.split(","))}

hvd.init()
start_rank = int(os.environ["HOROVOD_RANK"])
hostname = os.environ["HOROVOD_HOSTNAME"]
torch.manual_seed(0)
data, target = torch.randn(16, 2), torch.randint(0, 2, (16,))
model = torch.nn.Linear(2, 2)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     named_parameters=model.named_parameters())


def maybe_exit(epoch: int, batch: int) -> None:
    if start_rank in exits.get((epoch, batch), []):
        if args.exit_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"scheduled exit at epoch {epoch} batch {batch} (started as rank {start_rank})")


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    state.rendezvous += 1
    while state.epoch < args.epochs:
        while state.batch < args.batches:
            maybe_exit(state.epoch, state.batch)
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
            state.batch += 1
            state.commit()
        if hvd.rank() == 0:
            with open(args.log, "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "size": hvd.size(), "start_rank": start_rank,
                                    "hostname": hostname, "rendezvous": state.rendezvous}) + "\n")
        if state.epoch in wait_after:
            deadline = time.monotonic() + 120
            while not rt_elastic.hosts_updated() and time.monotonic() < deadline:
                time.sleep(0.2)
        state.epoch += 1
        state.batch = 0
        state.commit()


train(hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0, rendezvous=0))
