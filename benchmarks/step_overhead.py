"""What a gradient exchange adds to a training step, and what tensor fusion saves.

    python benchmarks/step_overhead.py           # N = 2 ranks, Gloo, one thread each
    python benchmarks/step_overhead.py --quick

Part 1, step time of the article's MNIST CNN (batch 64 per rank, SGD), all setups in one
job, taking turns (round robin, median of the rounds) so background load hits them alike:

    none        each rank steps alone: no exchange (the floor: an exchange fully hidden)
    ddp         torch.nn.parallel.DistributedDataParallel, bucket_cap_mb = --bucket-mb
    native      rt.DistributedOptimizer(strategy="native"), fusion_mb = --bucket-mb
    ring, ps    the same optimizer with strategy="ring" / "ps" (one server, rank 0)
    per-tensor  strategy="native" with fusion off (one exchange per parameter)

Part 2, tensor fusion: a model of --tensors small tensors (Linear(32, 32) layers). Comm
time is ``opt.synchronize()`` with no backward before it, i.e. packing, exchanging and
unpacking every bucket and nothing else; fused (one bucket) vs one bucket per tensor.

Prints tables and the ratios; writes JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_job import spawn_world  # noqa: E402  (the local-job helper)

SETUPS = ["none", "ddp", "native", "ring", "ps", "per-tensor"]


def mnist_cnn() -> Any:
    """The article's Keras MNIST example in PyTorch (1.2 M parameters, 8 tensors)."""
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.25), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(128, 10),
    )


def _build(setup: str, bucket_mb: float) -> tuple[Any, Any, Any]:
    """(module to call, optimizer, model) for one setup, all from the same weights."""
    import torch

    import ringtrain as rt

    torch.manual_seed(0)
    model = mnist_cnn()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if setup == "none":
        return model, sgd, model
    if setup == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        return ddp, sgd, model
    strategy = "native" if setup == "per-tensor" else setup
    fusion = 1e-6 if setup == "per-tensor" else bucket_mb  # 1 byte: a bucket per tensor
    opt = rt.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                  strategy=strategy, fusion_mb=fusion)
    return model, opt, model


def measure_steps(setups: list[str], rounds: int, steps: int, batch: int,
                  bucket_mb: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ringtrain as rt

    built = {s: _build(s, bucket_mb) for s in setups}
    g = torch.Generator().manual_seed(rt.rank())
    x = torch.randn(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step(setup: str) -> None:
        module, opt, _ = built[setup]
        opt.zero_grad()
        F.cross_entropy(module(x), y).backward()
        opt.step()

    for s in setups:  # warm up: allocations, buckets, channels, signature checks
        step(s)
        step(s)
    times: dict[str, list[float]] = {s: [] for s in setups}
    for _ in range(rounds):
        for s in setups:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(s)
            t = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[s].append(t.item())
    # The replicas that exchanged must still agree (a cheap correctness guard).
    agree = {}
    for s in setups:
        if s == "none":
            continue
        w = built[s][2][0].weight.detach().reshape(-1)[:64].clone()
        ref = rt.broadcast(w, root_rank=0)
        agree[s] = bool(torch.allclose(w, ref, atol=1e-6))
    return {"ms": {s: statistics.median(v) * 1e3 for s, v in times.items()},
            "all_ms": {s: [t * 1e3 for t in v] for s, v in times.items()}, "replicas_agree": agree}


def measure_fusion(tensors: int, rounds: int, reps: int, strategies: list[str]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import ringtrain as rt

    torch.manual_seed(0)
    layers = tensors // 2
    out: dict[str, Any] = {}
    for strategy in strategies:
        opts = {}
        for label, fusion_mb in (("fused", 25.0), ("per-tensor", 1e-6)):
            model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])
            opts[label] = rt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
                strategy=strategy, fusion_mb=fusion_mb)

        def exchange(opt: Any) -> None:
            opt.synchronize()  # no backward before: exchanges every bucket, nothing else
            with opt.skip_synchronize():
                opt.step()

        for opt in opts.values():
            exchange(opt)
        times: dict[str, list[float]] = {k: [] for k in opts}
        for _ in range(rounds):
            for label, opt in opts.items():
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    exchange(opt)
                t = torch.tensor([(time.perf_counter() - t0) / reps], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[label].append(t.item())
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[strategy] = {"ms": ms, "buckets": {k: len(o.bucket_names) for k, o in opts.items()},
                         "ratio": ms["per-tensor"] / ms["fused"]}
    out["tensors"] = 2 * layers
    out["bytes"] = layers * (32 * 32 + 32) * 4
    return out


def format_steps(res: dict[str, Any]) -> str:
    ms = res["ms"]
    lines = [f"{'setup':<11} {'ms/step':>8} {'vs none':>8} {'vs ddp':>8}"]
    for s, v in ms.items():
        vs_none = f"{v / ms['none']:.3f}" if "none" in ms else "-"
        vs_ddp = f"{v / ms['ddp']:.3f}" if "ddp" in ms else "-"
        lines.append(f"{s:<11} {v:8.1f} {vs_none:>8} {vs_ddp:>8}")
    return "\n".join(lines)


def format_fusion(res: dict[str, Any]) -> str:
    lines = [f"fusion: {res['tensors']} tensors, {res['bytes'] / 1024:.0f} KB of gradients",
             f"{'strategy':<8} {'fused ms':>9} {'per-tensor ms':>14} {'ratio':>7} {'buckets':>10}"]
    for s, r in res.items():
        if not isinstance(r, dict):
            continue
        b = r["buckets"]
        lines.append(f"{s:<8} {r['ms']['fused']:9.2f} {r['ms']['per-tensor']:14.2f} "
                     f"{r['ratio']:6.1f}x {b['fused']:>3} vs {b['per-tensor']}")
    return "\n".join(lines)


def _job(part: str, args: dict[str, Any]) -> dict[str, Any]:
    if part == "steps":
        return measure_steps(args["setups"], args["rounds"], args["steps"], args["batch"],
                             args["bucket_mb"])
    return measure_fusion(args["tensors"], args["rounds"], args["reps"], args["strategies"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--batch", type=int, default=64, help="per rank")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb = fusion_mb")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="steps per setup per round")
    p.add_argument("--tensors", type=int, default=256, help="small tensors in the fusion model")
    p.add_argument("--fusion-strategies", default="native,ring,ps")
    p.add_argument("--skip-steps", action="store_true")
    p.add_argument("--skip-fusion", action="store_true")
    p.add_argument("--json", default="out/bench_step_overhead.json")
    a = p.parse_args(argv)
    rounds = a.rounds or (3 if a.quick else 7)
    report: dict[str, Any] = {"meta": {"np": a.np, "cores": os.cpu_count(), "batch": a.batch,
                                       "bucket_mb": a.bucket_mb, "rounds": rounds}}
    if not a.skip_steps:
        args = {"setups": a.setups.split(","), "rounds": rounds, "steps": a.steps or (3 if a.quick else 5),
                "batch": a.batch, "bucket_mb": a.bucket_mb}
        res = spawn_world(_job, a.np, "steps", args)[0]
        report["steps"] = res
        print(f"one training step, MNIST CNN, batch {a.batch} per rank, N={a.np} (median of {rounds} rounds)")
        print(format_steps(res))
        if "ddp" in res["ms"] and "native" in res["ms"]:
            print(f"DistributedOptimizer(native) / DDP = {res['ms']['native'] / res['ms']['ddp']:.3f}")
        print(f"replicas agree after training: {res['replicas_agree']}")
    if not a.skip_fusion:
        args = {"tensors": a.tensors, "rounds": rounds, "reps": 3 if a.quick else 10,
                "strategies": a.fusion_strategies.split(",")}
        res = spawn_world(_job, a.np, "fusion", args)[0]
        report["fusion"] = res
        print(format_fusion(res))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
