"""What the collectives' shape check costs, against the seed CNN's training step.

    ringrun -np 2 python benchmarks/check_cost.py [--json FILE]

Every bare collective (``rt.allreduce`` of a metric, ...) first exchanges a small
header so mismatched shapes fail on every rank (ringtrain/agreement.py). The fused
gradient exchange of ``DistributedOptimizer`` does not pay it (its layout is checked
once). This measures, side by side in one run: a scalar ``rt.allreduce`` (header +
data), the same allreduce on ``torch.distributed`` without the check, and one training
step of the seed CNN (examples/mnist_cnn.py's model, batch 64 per rank); it prints the
check's cost as a share of that step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import ringtrain as rt  # noqa: E402


def _median_ms(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(n):
        rt.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    rt.init()
    torch.set_num_threads(1)
    from mnist_cnn import MnistCNN  # the seed CNN

    model = MnistCNN()
    opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    metric = torch.ones(1)
    checked = _median_ms(lambda: rt.allreduce(metric, name="loss"), args.iters)
    raw = _median_ms(lambda: dist.all_reduce(metric.clone()), args.iters)
    for _ in range(3):
        step()
    step_ms = _median_ms(step, max(10, args.iters // 10))
    cost = checked - raw
    if rt.rank() == 0:
        print(f"scalar rt.allreduce {checked:.3f} ms, raw all_reduce {raw:.3f} ms: the check costs "
              f"{cost:.3f} ms = {100 * cost / step_ms:.2f}% of the seed CNN's step ({step_ms:.1f} ms, "
              f"{rt.size()} ranks); the optimizer's own exchange pays nothing per step")
        if args.json:
            Path(args.json).write_text(json.dumps({"checked_ms": checked, "raw_ms": raw, "step_ms": step_ms,
                                                   "share": cost / step_ms, "ranks": rt.size()}))
    rt.shutdown()


if __name__ == "__main__":
    main()
