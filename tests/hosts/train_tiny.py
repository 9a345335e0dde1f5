"""A tiny, fully deterministic training job for the launcher's multi-host and chaos tests.

    ringrun -np 2 --max-restarts 3 python tests/hosts/train_tiny.py --steps 200 \
        --every 25 --checkpoint-dir DIR --out params.pt

CPU, fixed seeds, dropout (so the random generators must be restored on resume), SGD
with momentum (so the optimizer state must be restored) and a loader whose position
is its state. Rank 0 writes the final parameters to ``--out``.

Fault injection for tests: with ``CHAOS_PAUSE_RANK=r`` and ``CHAOS_PAUSE_STEP=s``, rank
r of the first attempt writes its pid to ``CHAOS_PAUSE_FILE`` before step s and waits
there to be killed (the test sends SIGKILL), so the kill lands at a chosen step; once
only (a job that Slurm requeues starts again at attempt 0, with the file present).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn

import ringtrain as rt
from ringtrain import elastic


class StepLoader:
    """An endless loader: batch i of rank r is a pure function of (seed, i, r, size)."""

    def __init__(self, seed: int, batch: int = 8) -> None:
        self.seed, self.batch, self.position = seed, batch, 0
        self.w = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position * rt.size() + rt.rank())
        self.position += 1
        x = torch.randn(self.batch, 16, generator=g)
        return x, (x @ self.w).argmax(1)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def _maybe_pause(step: int) -> None:
    if elastic.attempt() != 0 or os.environ.get("CHAOS_PAUSE_RANK") != str(rt.rank()):
        return
    if int(os.environ["CHAOS_PAUSE_STEP"]) != step:
        return
    if Path(os.environ["CHAOS_PAUSE_FILE"]).exists():
        return  # paused once already: a job Slurm requeued runs again from attempt 0
    tmp = os.environ["CHAOS_PAUSE_FILE"] + ".tmp"
    Path(tmp).write_text(str(os.getpid()))
    os.replace(tmp, os.environ["CHAOS_PAUSE_FILE"])
    time.sleep(120)  # the test kills us here


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()

    rt.init()
    torch.manual_seed(args.seed + rt.rank())  # different dropout masks per rank
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = StepLoader(args.seed)
    state = elastic.Resumable(args.checkpoint_dir, model=model, optimizer=opt, loader=loader,
                              every=args.every)
    start = state.resume()
    if start:
        print(f"resumed at step {start} (attempt {elastic.attempt()})", flush=True)
    if rt.rank() == 0:  # benchmarks/startup.py reads this line
        print(f"first step at {time.time():.6f}", flush=True)
    for step in range(start, args.steps):
        _maybe_pause(step)
        x, y = loader.next()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for param in model.parameters():
            rt.allreduce_(param.grad, op=rt.Average)
        opt.step()
        state.step_done(step + 1)
    if rt.rank() == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
        print(f"done {args.steps} steps", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
