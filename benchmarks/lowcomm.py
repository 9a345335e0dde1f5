"""Training over slow links: per-step ring exchange against rt.LocalSGD and rt.DiLoCo.

    python benchmarks/lowcomm.py [--quick] [--json out/lowcomm.json]     # shaped hosts (root)
    python benchmarks/lowcomm.py --loopback [--quick]                     # 4 local processes
    python benchmarks/lowcomm.py --loopback --ranks 2 --batch 8           # one rank per core
    python benchmarks/lowcomm.py --loopback --ranks 2 --batch 64 --steps 300 --eval-every 10 \
        --methods sync:1,localsgd:10,diloco:10 --target sync-third        # a larger batch

The article's MNIST CNN (examples/mnist_cnn.py, 1.2 M parameters, 4.8 MB of fp32
gradients) trains on the scikit-learn digits (upsampled to 28x28) on N = 4 ranks, one per
network-namespace host whose link tc shapes to 100 Mbit/s with 1 ms each way
(benchmarks/shaped_hosts.py), or on loopback. Every method trains the same model from
the same start on the same data (rt.data.Loader, 4 samples per rank per step, the same
order), with Adam (lr 1e-3, cosine-decayed to a tenth over the run) as the optimizer that
steps every step:

==========  ================================================================
method      exchange
==========  ================================================================
sync        rt.DistributedOptimizer(Adam, strategy="ring"): every step
localsgd    rt.LocalSGD(model, Adam, sync_every=H, strategy="ring")
diloco      rt.DiLoCo(model, Adam, SGD(lr 0.7, momentum 0.9, Nesterov), sync_every=H,
            strategy="ring") (the paper's outer optimizer)
==========  ================================================================

at H in {10, 50}. Every 50 steps (a sync point of every method) the clocks stop, the
ranks meet, rank 0 measures the loss of the model on a fixed set of 512 training samples
(the training objective; the held-out split's loss is recorded too), and the clocks go
on (``--eval-every`` changes the 50; every method's H must divide it). ``--target
sync-third`` applies the rule that fixed the default target (below) to the measured
synchronous run instead of the simulation: the target is the loss it reached at the first
evaluation at or after a third of its steps. Per run: ``wall_s_to_target`` (rank 0's training time, evaluations excluded, at the
first evaluation with a loss <= the target), ``bytes_per_rank`` (what each rank's
network card sent during training, /sys/class/net/eth0 in its namespace, the mean of the
ranks; on loopback the bytes handed to the ring: 2(N-1)/N per exchanged byte),
``final_loss`` (after the same number of samples for every method). Rounds take turns
(each round runs every method once, in a rotated order), and the table shows medians
and ratios to ``sync``.

The planner (ringtrain.plan.lowcomm, as `ringtrain plan --lowcomm` computes it) predicts
each method's step from the link (the measured rate and round trip of the hosts) and
the measured step without exchange (the mean local step of the periodic runs with the
largest H: diloco H=50);
the table compares it with the measured step (training time / steps).

The JSON is a list of records (one per run, then a summary per method with
``"summary": true``) with ``method`` (sync, localsgd, diloco), ``sync_every``,
``wall_s_to_target``, ``bytes_per_rank``, ``final_loss`` and more; each record's ``meta``
holds the link, the target and the settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

__all__ = ["METHODS", "TARGET", "main", "predict", "rank_main", "summarize"]

N = 4
BATCH = 4  # samples per rank per step: the step is mostly exchange on the 100 Mbit/s links
EVAL_EVERY = 50  # a sync point of every method (H = 1, 10, 50)
LR = 1e-3
#: The target loss (mean cross-entropy on the 512 fixed training samples). Chosen before
#: the shaped-host runs by a rule, from a one-process simulation of the same training
#: (docs/lowcomm.md): the loss synchronous training reaches after a third of the full run
#: (0.077 at step 200 of 800 in the simulation), rounded.
TARGET = 0.08
METHODS: list[tuple[str, int]] = [("sync", 1), ("localsgd", 10), ("localsgd", 50), ("diloco", 10),
                                  ("diloco", 50)]
MBIT, DELAY_MS = 100.0, 1.0


# -- one rank ------------------------------------------------------------------------------


def _tx_bytes(iface: str) -> int | None:
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except OSError:
        return None


def rank_main(job_file: str) -> int:
    """One rank of one round: every method in turn (one start-up for all), in the
    round's order; rank 0 writes the records."""
    import torch

    import ringtrain as rt

    job = json.loads(Path(job_file).read_text())
    torch.set_num_threads(1)
    rt.init()
    try:
        records = [_train(method, h, int(job["steps"]), job["iface"], int(job["batch"]), float(job["lr"]),
                          int(job.get("eval_every", EVAL_EVERY)))
                   for method, h in job["methods"]]
        if rt.rank() == 0:
            Path(job["out"]).write_text(json.dumps(records))
    finally:
        rt.shutdown()
    return 0


def _train(method: str, h: int, steps: int, iface: str, batch: int, lr: float,
           eval_every: int = EVAL_EVERY) -> dict[str, Any]:
    """Train one method from the common start; rank 0's record (None elsewhere)."""
    import torch
    import torch.nn.functional as F
    from mnist_cnn import MnistCNN, load_digits_28x28

    import ringtrain as rt

    train, test = load_digits_28x28()
    torch.manual_seed(0)
    model = MnistCNN()  # the same start on every rank, for every method
    torch.manual_seed(1 + rt.rank())  # each rank's own dropout
    inner = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        inner, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    sent = [0]
    if method == "sync":
        opt: Any = rt.DistributedOptimizer(inner, named_parameters=model.named_parameters(), strategy="ring")
        opt.exchange_listeners.append(lambda _name, nbytes, _a, _b: sent.__setitem__(0, sent[0] + nbytes))
    elif method == "localsgd":
        opt = rt.LocalSGD(model, inner, sync_every=h, strategy="ring")
    else:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        opt = rt.DiLoCo(model, inner, outer, sync_every=h, strategy="ring")
    loader = rt.data.Loader(train, batch_size=batch, shuffle=True, seed=0, num_workers=0, drop_last=True)
    x_all, y_all = train.tensors
    pick = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(7))[:512]
    probe_x, probe_y = x_all[pick], y_all[pick]
    test_x, test_y = test.tensors

    def evaluate() -> tuple[float, float]:
        model.eval()
        with torch.no_grad():
            a = F.cross_entropy(model(probe_x), probe_y).item()
            b = F.cross_entropy(model(test_x), test_y).item()
        model.train()
        return a, b

    rt.barrier()
    tx0 = _tx_bytes(iface)
    clock, step, epoch = 0.0, 0, 0
    curve: list[tuple[int, float, float, float]] = []
    step_times: list[tuple[float, bool]] = []
    syncs_before = 0
    while step < steps:
        loader.set_epoch(epoch)
        t_last = time.perf_counter()
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            schedule.step()
            step += 1
            now = time.perf_counter()
            synced = method == "sync" or opt.syncs > syncs_before
            syncs_before = 0 if method == "sync" else opt.syncs
            step_times.append((now - t_last, synced))
            clock += now - t_last
            if step % eval_every == 0 or step == steps:
                rt.barrier()  # clocks stop: every rank is here, none computes meanwhile
                loss, held_out = evaluate() if rt.rank() == 0 else (math.nan, math.nan)
                rt.barrier()
                curve.append((step, clock, loss, held_out))
            t_last = time.perf_counter()
            if step == steps:
                break
        epoch += 1
    tx1 = _tx_bytes(iface)
    payload = sent[0] if method == "sync" else opt.exchanged_bytes
    mine = {"tx": None if tx0 is None or tx1 is None else tx1 - tx0,
            "payload": payload * 2 * (rt.size() - 1) / rt.size()}
    everyone = rt.allgather_object(mine)
    del opt  # its parameters are free for the next method's optimizer
    local = sorted(t for t, s in step_times[1:] if not s)
    synced_steps = sorted(t for t, s in step_times[1:] if s)
    return {
        "method": method, "sync_every": h, "steps": steps, "n": rt.size(),
        "train_s": clock, "step_s": clock / steps,
        "local_step_s": statistics.median(local) if local else None,
        "local_step_mean_s": statistics.mean(local) if local else None,
        "sync_step_s": statistics.median(synced_steps) if synced_steps else None,
        "curve": curve,
        "nic_bytes_per_rank": (statistics.mean(e["tx"] for e in everyone)
                               if all(e["tx"] is not None for e in everyone) else None),
        "payload_bytes_per_rank": statistics.mean(e["payload"] for e in everyone),
        "final_loss": curve[-1][2], "final_held_out_loss": curve[-1][3],
    }


# -- the driver ------------------------------------------------------------------------------


def _to_target(curve: list[list[float]], target: float) -> float | None:
    for _step, clock, loss, _held in curve:
        if loss <= target:
            return float(clock)
    return None


def sync_third_target(records: list[dict[str, Any]], steps: int) -> float:
    """The rule behind TARGET, applied to a measured synchronous run: its loss at the first
    evaluation at or after a third of its steps."""
    sync = next((r for r in records if r["method"] == "sync"), None)
    if sync is None:
        raise ValueError("--target sync-third needs the sync method in --methods")
    return float(next(loss for step, _clock, loss, _held in sync["curve"] if step >= steps / 3))


def _loopback_launch(argv: list[str], n: int, timeout_s: float) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", RINGTRAIN_PROGRESS="0")
    ringrun = Path(sys.executable).with_name("ringrun")
    res = subprocess.run([str(ringrun), "-np", str(n), "--oversubscribe", *argv], env=env,
                         capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"ringrun exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")


def run(rounds: int, steps: int, loopback: bool, methods: list[tuple[str, int]], timeout_s: float = 1800,
        prefix: str = "rtsh", subnet: str = "10.213.70", n: int = N,
        batch: int = BATCH, lr: float = LR, eval_every: int = EVAL_EVERY,
        target: float | None = TARGET) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every method once per round, rounds taking turns; (records, meta). ``target=None``:
    the sync-third rule on each round's synchronous run (training is deterministic, so
    every round's is the same)."""
    import shaped_hosts

    hosts = None
    meta: dict[str, Any] = {"n": n, "batch_per_rank": batch, "steps": steps, "rounds": rounds,
                            "target": target, "eval_every": eval_every,
                            "target_rule": "fixed" if target is not None else "sync-third", "lr": lr, "host": platform.node(), "cores": os.cpu_count(),
                            "transport": "loopback" if loopback else "shaped-veth"}
    if not loopback:
        hosts = shaped_hosts.build(n, MBIT, DELAY_MS, prefix=prefix, subnet=subnet)
        rate = shaped_hosts.probe_rate(hosts)
        rtt = shaped_hosts.probe_rtt(hosts)
        meta.update(link_mbit=MBIT, delay_ms=hosts.delay_ms, qdisc=hosts.qdisc, probe_mbit=rate,
                    rtt_ms_median=rtt[len(rtt) // 2])
        print(f"# {n} hosts, {hosts.qdisc}; one TCP stream carries {rate:.1f} Mbit/s, round trip "
              f"{rtt[len(rtt) // 2]:.2f} ms", file=sys.stderr)
    records: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ringtrain-lowcomm-") as tmp:
            os.chmod(tmp, 0o755)
            for r in range(rounds):
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                job = {"methods": order, "steps": steps, "out": f"{tmp}/rec-{r}.json", "batch": batch, "lr": lr,
                       "eval_every": eval_every, "iface": "lo" if loopback else "eth0"}
                job_file = f"{tmp}/job-{r}.json"
                Path(job_file).write_text(json.dumps(job))
                argv = [sys.executable, str(Path(__file__).resolve()), "--rank-job", job_file]
                t0 = time.time()
                if hosts is None:
                    _loopback_launch(argv, n, timeout_s)
                else:
                    shaped_hosts.launch(hosts, argv, timeout_s=timeout_s, env={"RINGTRAIN_PROGRESS": "0"})
                round_records = json.loads(Path(job["out"]).read_text())
                goal = target if target is not None else sync_third_target(round_records, steps)
                if target is None:
                    meta["target"] = goal
                for rec in round_records:
                    rec["round"] = r
                    rec["target"] = goal
                    rec["wall_s_to_target"] = _to_target(rec["curve"], goal)
                    rec["bytes_per_rank"] = (rec["payload_bytes_per_rank"] if loopback
                                             else rec["nic_bytes_per_rank"])
                    records.append(rec)
                    print(f"# round {r} {rec['method']} H={rec['sync_every']}: {rec['train_s']:.1f} s "
                          f"training, to target {rec['wall_s_to_target']}, final loss "
                          f"{rec['final_loss']:.4f}", file=sys.stderr)
                print(f"# round {r}: {time.time() - t0:.0f} s with start-up", file=sys.stderr)
    finally:
        if hosts is not None:
            shaped_hosts.teardown(hosts)
    return records, meta


def _scenario(meta: dict[str, Any], compute_s: float) -> Any:
    """The planner's scenario for these runs: the CNN, the link, the step without exchange."""
    import torch
    from mnist_cnn import MnistCNN

    from ringtrain.plan import FRAMEWORKS, Scenario, Topology, from_module, intra_link, link
    from ringtrain.plan.network import with_rtt

    if meta["transport"] == "loopback":
        inter = link("loopback")
    else:
        inter = with_rtt(link(f"{meta['link_mbit']:g}mbit"), meta["rtt_ms_median"])
    layers = from_module(MnistCNN(), torch.randn(1, 1, 28, 28))
    return Scenario(tuple(layers), compute_s, Topology(1, intra_link("pcie3"), inter), "ring",
                    FRAMEWORKS["ddp"], batch=meta["batch_per_rank"])


def predict(meta: dict[str, Any], compute_s: float, sync_every: list[int]) -> dict[tuple[str, int], float]:
    """The planner's step time per (method, H) for these runs (see the module doc)."""
    from ringtrain.plan.lowcomm import mode_costs

    costs = mode_costs(_scenario(meta, compute_s), meta["n"], sync_every)
    return {(c.mode, c.sync_every): c.step_s for c in costs}


def advise(meta: dict[str, Any], compute_s: float) -> Any:
    """What ``ringtrain plan --lowcomm`` advises for these runs (its Advice)."""
    from ringtrain.plan.lowcomm import recommend

    return recommend(_scenario(meta, compute_s), meta["n"])


def summarize(records: list[dict[str, Any]], meta: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Per method: medians, ratios to sync, the planner's step; (summary records, table)."""
    keys = list(dict.fromkeys((r["method"], r["sync_every"]) for r in records))
    by = {k: [r for r in records if (r["method"], r["sync_every"]) == k] for k in keys}

    def med(values: list[Any]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if vals and len(vals) == len(values) else None

    # The step without exchange: the mean local step of the periodic runs with the
    # largest H (diloco H=50 in the full set), which sync least often.
    periodic = sorted((k for k in keys if k[0] != "sync"), key=lambda k: (-k[1], k[0] != "diloco"))
    source = periodic[0] if periodic else None
    local = [r["local_step_mean_s"] for r in by.get(source, []) if r["local_step_mean_s"]] if source else []
    compute_s = statistics.median(local) if local else None
    predicted = predict(meta, compute_s, sorted({h for _, h in keys if h > 1})) if compute_s else {}
    summary = []
    for k in keys:
        rs = by[k]
        summary.append({
            "method": k[0], "sync_every": k[1], "runs": len(rs), "summary": True,
            "wall_s_to_target": med([r["wall_s_to_target"] for r in rs]),
            "bytes_per_rank": med([r["bytes_per_rank"] for r in rs]),
            "final_loss": med([r["final_loss"] for r in rs]),
            "final_held_out_loss": med([r["final_held_out_loss"] for r in rs]),
            "step_s": med([r["step_s"] for r in rs]),
            "predicted_step_s": predicted.get(k),
        })
    base = next((s for s in summary if s["method"] == "sync"), None)
    advice = advise(meta, compute_s) if compute_s else None
    reached = [s for s in summary if s["wall_s_to_target"]]
    fastest = min(reached, key=lambda s: s["wall_s_to_target"]) if reached else None
    for s in summary:
        s["planner_says_periodic_pays"] = advice.pays if advice else None
        s["fastest_to_target"] = s is fastest
    lines = [f"{'method':<9} {'H':>3} | {'to target s':>11} {'speedup':>8} | {'MB/rank':>9} {'fewer':>7} | "
             f"{'final loss':>10} {'vs sync':>8} | {'step ms':>8} {'planner':>8} {'error':>7}"]
    for s in summary:
        ratio = (base["wall_s_to_target"] / s["wall_s_to_target"]
                 if base and base["wall_s_to_target"] and s["wall_s_to_target"] else None)
        fewer = base["bytes_per_rank"] / s["bytes_per_rank"] if base and s["bytes_per_rank"] else None
        loss_vs = s["final_loss"] / base["final_loss"] - 1 if base and base["final_loss"] else None
        err = (s["predicted_step_s"] / s["step_s"] - 1) if s["predicted_step_s"] and s["step_s"] else None
        s.update(speedup_to_target=ratio, fewer_bytes=fewer, final_loss_vs_sync=loss_vs, planner_error=err)
        lines.append(
            f"{s['method']:<9} {s['sync_every']:>3} | "
            + (f"{s['wall_s_to_target']:>11.1f} " if s["wall_s_to_target"] else f"{'not reached':>11} ")
            + (f"{ratio:>7.2f}x" if ratio else f"{'-':>8}") + " | "
            + f"{s['bytes_per_rank'] / 2**20:>9.1f} " + (f"{fewer:>6.1f}x" if fewer else f"{'-':>7}") + " | "
            + f"{s['final_loss']:>10.4f} " + (f"{loss_vs:>+8.1%}" if loss_vs is not None else f"{'-':>8}") + " | "
            + f"{s['step_s'] * 1e3:>8.1f} "
            + (f"{s['predicted_step_s'] * 1e3:>8.1f} {err:>+7.1%}" if err is not None else f"{'-':>8} {'-':>7}"))
    lines.append(f"(medians of {meta['rounds']} round(s); target loss {meta['target']:.4g}; {meta['steps']} steps "
                 f"x {meta['n']} ranks x {meta['batch_per_rank']} samples; inner lr {meta.get('lr', LR):g}; "
                 "planner: compute "
                 + (f"{compute_s * 1e3:.1f} ms per step (mean local step of {source[0]} H={source[1]})"
                    if compute_s and source else "unknown (no periodic run)") + ")")
    if advice is not None and fastest is not None:
        agree = advice.pays == (fastest["method"] != "sync")
        lines.append(f"planner: {advice.text.split(':')[0]}; fastest to the target: {fastest['method']}"
                     + (f" H={fastest['sync_every']}" if fastest["method"] != "sync" else "")
                     + f" ({'agrees' if agree else 'disagrees'})")
    return summary, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round of 150 steps (within 6 minutes here)")
    p.add_argument("--rounds", type=int, help="rounds (default 3, --quick 1)")
    p.add_argument("--steps", type=int, help="steps per run (default 600, --quick 150)")
    p.add_argument("--loopback", action="store_true", help="local processes instead of shaped hosts")
    p.add_argument("--ranks", type=int, default=N, help=f"ranks (default {N}; one per core on loopback: 2 here)")
    p.add_argument("--batch", type=int, default=BATCH,
                   help=f"samples per rank per step (default {BATCH}; keep ranks x batch = 16 for the target)")
    p.add_argument("--lr", type=float, default=LR,
                   help=f"the inner (every-step) optimizer's learning rate, every method (default {LR:g})")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY,
                   help=f"steps between evaluations (default {EVAL_EVERY}; a multiple of every H)")
    p.add_argument("--target", default=str(TARGET),
                   help=f"target loss (default {TARGET}), or sync-third: the synchronous run's loss "
                        "after a third of its steps")
    p.add_argument("--methods", help="comma list of method:H (default all: sync:1,localsgd:10,...)")
    p.add_argument("--json", help="write the records to this file")
    p.add_argument("--netns-prefix", default="rtsh", help="names of the shaped hosts (default rtsh)")
    p.add_argument("--netns-subnet", default="10.213.70", help="their /24 (default 10.213.70)")
    p.add_argument("--rank-job", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_job:
        return rank_main(args.rank_job)
    if not args.loopback:
        import shaped_hosts

        reason = shaped_hosts.requirements()
        if reason:
            print(f"lowcomm: {reason} (or run with --loopback)", file=sys.stderr)
            return 2
    if args.ranks < 2 or args.batch < 1:
        p.error(f"--ranks must be >= 2 and --batch >= 1, got {args.ranks} and {args.batch}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (150 if args.quick else 600)
    methods = METHODS
    if args.methods:
        methods = []
        for item in args.methods.split(","):
            name, _, h = item.partition(":")
            if name not in ("sync", "localsgd", "diloco") or not h.isdigit() or int(h) < 1 \
                    or (name == "sync") != (int(h) == 1):
                p.error(f"--methods: {item!r} is not METHOD:H (sync:1, localsgd:H or diloco:H with H >= 2), "
                        "e.g. --methods sync:1,diloco:50")
            methods.append((name, int(h)))
    if args.eval_every < 1 or any(args.eval_every % h for _, h in methods):
        p.error(f"--eval-every must be a multiple of every method's H (evaluations at sync points), "
                f"got {args.eval_every} for H = {sorted({h for _, h in methods})}")
    target: float | None
    if args.target == "sync-third":
        if ("sync", 1) not in methods:
            p.error("--target sync-third needs sync:1 in --methods")
        target = None
    else:
        try:
            target = float(args.target)
        except ValueError:
            target = math.nan
        if not (math.isfinite(target) and target > 0):
            p.error(f"--target must be a loss > 0 or sync-third, got {args.target!r}")
    records, meta = run(rounds, steps, args.loopback, methods, prefix=args.netns_prefix,
                        subnet=args.netns_subnet, n=args.ranks, batch=args.batch, lr=args.lr,
                        eval_every=args.eval_every, target=target)
    summary, table = summarize(records, meta)
    print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{**r, "meta": meta} for r in records + summary], indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
