"""What the step meter costs: per-step listener time, and a training loop with it on and off.

    python benchmarks/meter_overhead.py [--steps 200] [--reps 5] [--out runs/bench/meter_overhead.json]

Two measurements, both in one process, compared as ratios inside this run:

1. *Listener cost*: a typical step's events (one data wait, four bucket exchanges, the
   exchange wait, the update, the step end) pushed through ``ringtrain.events`` with
   the meter on (timeline off / on) and with no listener; microseconds per step.
2. *Training loop*: a 3-layer MLP (batch 64, 1 thread) trained with
   ``DistributedOptimizer`` and ``rt.observe.instrument`` with the meter off, on, and on
   with the timeline; modes interleaved rep by rep, median step time per mode.

The goal (issue 6) is an overhead under 2% of the step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ringtrain as rt
from ringtrain import events, observe

_BUCKETS = 4


def listener_cost(steps: int) -> float:
    """Seconds per step spent emitting one step's events to whatever listens now."""
    names = [f"layer{i}.weight" for i in range(8)]
    t = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        events.emit("data_wait", t, t + 0.001, samples=64, batch=1, batches=100, epoch=0,
                    workers=2, source="Loader")
        for b in range(_BUCKETS):
            events.emit("exchange", t + 0.002, t + 0.004, name=f"bucket{b}", bytes=1 << 20,
                        tensors=names)
        events.emit("exchange_wait", t + 0.004, t + 0.005)
        events.emit("update", t + 0.005, t + 0.006)
        events.emit("step_end", t + 0.006, t + 0.006)
        t += 0.006
    return (time.perf_counter() - start) / steps


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer,
                data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    times = []
    for x, y in observe.instrument(data):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def mode(name: str, timeline_dir: str) -> None:
    observe.stop()
    if name == "meter":
        observe.start(progress=False, timeline="", gpu=False)
    elif name == "meter+timeline":
        observe.start(progress=False, timeline=f"{timeline_dir}/t.json", gpu=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps per mode and rep")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="runs/bench/meter_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rt.init()
    modes = ["off", "meter", "meter+timeline"]
    with tempfile.TemporaryDirectory() as tmp:
        listener: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.reps):
            for m in modes:
                mode(m, tmp)
                listener[m].append(listener_cost(2000))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 10))
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(), fusion_mb=0.5)
        data = [(torch.randn(64, 256), torch.randint(0, 10, (64,))) for _ in range(args.steps)]
        mode("off", tmp)
        train_steps(model, opt, data[:20])  # warm up allocator and threads
        step: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.reps):
            for m in modes:
                mode(m, tmp)
                step[m].append(statistics.median(train_steps(model, opt, data)))
        observe.stop()
    base = statistics.median(step["off"])
    base_listener = statistics.median(listener["off"])
    rows = []
    for m in modes:
        per_step_us = (statistics.median(listener[m]) - base_listener) * 1e6
        median = statistics.median(step[m])
        rows.append({"mode": m, "listener_us_per_step": per_step_us,
                     "train_step_ms": median * 1e3,
                     "train_overhead": median / base - 1.0,
                     "listener_share_of_step": per_step_us * 1e-6 / base})
    print(f"{'mode':<16} {'listener us/step':>17} {'train step ms':>14} {'overhead':>9} "
          f"{'listener/step':>14}")
    for r in rows:
        print(f"{r['mode']:<16} {r['listener_us_per_step']:>17.1f} {r['train_step_ms']:>14.3f} "
              f"{r['train_overhead']:>+9.2%} {r['listener_share_of_step']:>14.2%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "reps": args.reps, "buckets": _BUCKETS,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    rt.shutdown()


if __name__ == "__main__":
    main()
