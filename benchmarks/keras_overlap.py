"""Keras step time: no exchange, exchange after backward, exchange overlapping backward, torch.

    python benchmarks/keras_overlap.py                       # 2 local ranks, Gloo on loopback
    python benchmarks/keras_overlap.py --shaped-mbit 200     # 2 hosts, 200 Mbit/s links (root)

The model of examples/keras_mnist.py (the article's CNN, 1.2 M parameters), Adadelta,
batch 64 per rank, one thread per rank, N = 2. Setups, all in one job, taking turns
(round robin, median of the rounds) so background load hits them alike:

    keras-none      the Keras optimizer alone: no exchange (the floor)
    keras-after     rtk.DistributedOptimizer(overlap=False): buckets exchanged after backward
    keras-overlap   rtk.DistributedOptimizer(): each bucket starts as its gradients are ready
    torch-none      the same CNN in torch, plain optimizer
    torch           rt.DistributedOptimizer on it (post-accumulate-grad hooks, the same fusion)

Overlap needs more than one bucket: the whole model is 4.8 MB, one 25 MB bucket by
default, which can start only when backward is over. ``--fusion-mb`` (default 1) cuts it
as DDP's first bucket does: the 4.7 MB Dense kernel, whose gradient is ready early in
backward, goes alone, and travels while the convolutions' backward runs.

On loopback both ranks share two cores and the exchange is CPU copies competing with
compute (overlap buys little there, as docs/sync.md measures); on shaped links (``--shaped-mbit``) the
exchange is time on a wire and overlap can hide it behind backward.

Prints the table with each setup's time over keras-none and over torch; writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from local_job import spawn_world  # noqa: E402  (the local-job helper)

SETUPS = ["keras-none", "keras-after", "keras-overlap", "torch-none", "torch"]
# The ranks' environment: Keras on torch; no progress lines from rank 0's step meter.
_ENV = {"KERAS_BACKEND": "torch", "RINGTRAIN_PROGRESS": "0"}


def _keras_model() -> Any:
    spec = importlib.util.spec_from_file_location("keras_mnist", HERE.parent / "examples" / "keras_mnist.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.mnist_cnn()


def _build(setup: str, fusion_mb: float) -> tuple[Any, Any]:
    """(step function, optimizer or None) of one setup."""
    import torch

    import ringtrain as rt
    import ringtrain.keras as rtk  # sets KERAS_BACKEND=torch, so it comes before keras

    # isort: split
    import keras

    if setup.startswith("keras"):
        keras.utils.set_random_seed(0)
        model = _keras_model()
        opt: Any = keras.optimizers.Adadelta(learning_rate=1.0)
        if setup != "keras-none":
            opt = rtk.DistributedOptimizer(opt, fusion_mb=fusion_mb, overlap=setup == "keras-overlap")
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")

        def keras_step(x: Any, y: Any) -> None:
            model.train_on_batch(x.permute(0, 2, 3, 1), y)

        return keras_step, opt
    from ringtrain.plan.calibrate import mnist_cnn

    torch.manual_seed(0)
    net = mnist_cnn()
    topt: Any = torch.optim.Adadelta(net.parameters(), lr=1.0)
    if setup == "torch":
        topt = rt.DistributedOptimizer(topt, named_parameters=net.named_parameters(), fusion_mb=fusion_mb)

    def torch_step(x: Any, y: Any) -> None:
        topt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        topt.step()

    return torch_step, None


def measure(setups: list[str], rounds: int, steps: int, batch: int, fusion_mb: float) -> dict[str, Any]:
    """Runs on every rank after rt.init(); ms per step of each setup (slowest rank)."""
    import torch
    import torch.distributed as dist

    import ringtrain as rt

    torch.set_num_threads(1)
    built = {s: _build(s, fusion_mb) for s in setups}
    g = torch.Generator().manual_seed(rt.rank())
    x = torch.randn(batch, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    for step, _ in built.values():  # warm up: Keras builds and traces, buckets, channels
        for _ in range(3):
            step(x, y)
    times: dict[str, list[float]] = {s: [] for s in setups}
    exposed: dict[str, list[float]] = {s: [] for s in setups}
    for _ in range(rounds):
        for s in setups:
            step, opt = built[s]
            dist.barrier()
            t0 = time.perf_counter()
            waited = 0.0
            for _ in range(steps):
                step(x, y)
                if opt is not None and hasattr(opt, "exchange"):
                    waited += opt.exchange.last_exchange_s
            t = torch.tensor([(time.perf_counter() - t0) / steps, waited / steps], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[s].append(t[0].item())
            exposed[s].append(t[1].item())
    return {"ms": {s: 1e3 * statistics.median(v) for s, v in times.items()},
            "all_ms": {s: [1e3 * t for t in v] for s, v in times.items()},
            "best_ms": {s: 1e3 * min(v) for s, v in times.items()},
            "exchange_wait_ms": {s: 1e3 * statistics.median(v) for s, v in exposed.items()},
            "n": rt.size()}


def format_table(res: dict[str, Any]) -> str:
    ms, best = res["ms"], res["best_ms"]
    base, torch_ms = ms.get("keras-none"), ms.get("torch")
    lines = [f"{'setup':>14} {'ms/step':>9} {'vs keras-none':>14} {'vs torch':>9} {'best round':>11} "
             f"{'apply waits ms':>15}"]
    for s, v in ms.items():
        wait = res["exchange_wait_ms"].get(s, 0.0)
        lines.append(f"{s:>14} {v:9.1f} {v / base if base else float('nan'):14.3f} "
                     f"{v / torch_ms if torch_ms else float('nan'):9.3f} {best[s]:11.1f} "
                     f"{(f'{wait:.1f}' if s.startswith('keras-') and s != 'keras-none' else '-'):>15}")
    after, over = ms.get("keras-after"), ms.get("keras-overlap")
    if after and over:
        lines.append(f"keras-overlap / keras-after = {over / after:.3f}")
    return "\n".join(lines)


def rank_main(job_file: str) -> int:
    import ringtrain as rt

    job = json.loads(Path(job_file).read_text())
    rt.init()
    try:
        res = measure(job["setups"], job["rounds"], job["steps"], job["batch"], job["fusion_mb"])
        if rt.rank() == 0:
            Path(job["out"]).write_text(json.dumps(res))
    finally:
        rt.shutdown()
    return 0


def _run_shaped(mbit: float, job: dict[str, Any]) -> dict[str, Any]:
    import shaped_hosts

    hosts = shaped_hosts.build(2, mbit, 0.0)
    try:
        with tempfile.TemporaryDirectory(prefix="ringtrain-keras-") as tmp:
            job = {**job, "out": f"{tmp}/out.json"}
            Path(f"{tmp}/job.json").write_text(json.dumps(job))
            shaped_hosts.launch(hosts, [sys.executable, __file__, "--rank-job", f"{tmp}/job.json"],
                                env=_ENV, timeout_s=3600)
            res: dict[str, Any] = json.loads(Path(job["out"]).read_text())
    finally:
        shaped_hosts.teardown(hosts)
    res["link"] = f"2 namespace hosts, {hosts.qdisc}"
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=5, help="steps per round and setup")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--fusion-mb", type=float, default=1.0, help="bucket size for every setup")
    p.add_argument("--shaped-mbit", type=float, default=None,
                   help="run on 2 network-namespace hosts with links shaped to this rate (root)")
    p.add_argument("--json", default="out/bench_keras_overlap.json")
    p.add_argument("--rank-job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_job:
        return rank_main(args.rank_job)
    job = {"setups": args.setups.split(","), "rounds": args.rounds, "steps": args.steps,
           "batch": args.batch, "fusion_mb": args.fusion_mb}
    if args.shaped_mbit:
        import shaped_hosts

        reason = shaped_hosts.requirements()
        if reason:
            print(f"keras_overlap.py: --shaped-mbit: {reason}", file=sys.stderr)
            return 2
        res = _run_shaped(args.shaped_mbit, job)
    else:
        res = spawn_world(measure, 2, job["setups"], job["rounds"], job["steps"], job["batch"],
                          job["fusion_mb"], env=_ENV)[0]
        res["link"] = "2 local processes, Gloo on loopback"
    res.update(fusion_mb=args.fusion_mb, batch=args.batch, steps=args.steps, rounds=args.rounds)
    print(f"# {res['link']}; batch {args.batch} per rank, fusion {args.fusion_mb:g} MB, "
          f"median of {args.rounds} rounds of {args.steps} steps")
    print(format_table(res))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
