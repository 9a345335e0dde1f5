"""Allreduce algorithms side by side: native (Gloo/NCCL), ring, ps with 1 server, ps with N.

    python benchmarks/allreduce.py            # N = 2, 4, 8; 4 KB .. 64 MB
    python benchmarks/allreduce.py --quick    # fewer sizes and repetitions (~1 min)

Every N runs as one job of N local processes (Gloo over loopback, one thread each).
On a machine with fewer cores than N the processes share cores (oversubscribed): the
numbers then measure CPU work as much as transfers, so compare algorithms within one N
and one run, never absolute times across machines.

Reported as NCCL-tests defines them (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
time is the slowest rank's time per operation, algbw = bytes / time, and
busbw = algbw * 2(N-1)/N, the rate each rank's link runs at for an allreduce, comparable
across N. The algorithms take turns within each size (round robin, median of the
rounds) so background load hits all of them alike.

``--link-mbps R`` adds a link model for ring and ps: each rank's outgoing and incoming
traffic is paced to R MB/s (a sleep per piece, no CPU burnt), as if every rank had its
own network card of that speed. That separates the algorithms' traffic patterns from
the CPU cost of loopback copies, which on a 2-core machine dominates everything.

``--shaped-hosts 2,3,4,6 --link-mbit R`` (as root) runs one rank per network-namespace
host instead, each host with its own link shaped by tc to R Mbit/s per direction: the
kernel's real network path, no model (``allreduce_shaped.py``, ``shaped_hosts.py``).

Outputs: a table on stdout, JSON (--json) and a PNG of time vs N per algorithm (--png).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
ALGORITHMS = ["native", "ring", "ps1", "psN"]


# -- spawning a local job (shared with step_overhead.py) -------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, n: int, port: int, args: tuple, out: Any,
           env: dict[str, str]) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **env,
    )
    import torch

    torch.set_num_threads(1)
    import ringtrain as rt

    rt.init()
    try:
        value = fn(*args)
        out.put((rank, True, value))
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        import traceback

        out.put((rank, False, f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        rt.shutdown()


def spawn_world(fn: Callable[..., Any], n: int, *args: Any, timeout: float = 3600,
                env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on n local ranks after ``rt.init()``; results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, n, port, args, out, env or {}), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n:
            try:
                rank, ok, value = out.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    raise RuntimeError(f"ranks {sorted(set(range(n)) - set(got))} did not report") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(n)]


# -- the measurement (runs on every rank) ----------------------------------------------

def _algorithm(name: str, n: int, link_mbps: float | None) -> Any:
    from ringtrain import sync

    if name == "native":
        return "native"
    kinds: dict[str, tuple[type, dict[str, int]]] = {
        "ring": (sync.Ring, {}),
        "ps1": (sync.ParameterServer, {"servers": 1}),
        "psN": (sync.ParameterServer, {"servers": n}),
    }
    cls, kw = kinds[name]
    if link_mbps:
        return _paced_class(cls)(link_mbps, **kw)
    return cls(**kw)


class _PacedChannel:
    """A channel whose links run at ``rate`` bytes/s per rank and direction.

    Egress: sends go through a pacing thread that releases each one when the rank's
    outgoing link would have finished transmitting it (the exchange thread does not
    block). Ingress: a completed receive is held until the rank's incoming link could
    have taken it, so N-1 workers sending to one server at once share its link. Time is
    spent sleeping, not computing, so the model measures traffic patterns, not copies.
    Host (Gloo) channels only: each message is posted on its own.
    """

    lockstep = False

    def __init__(self, inner: Any, rate: float) -> None:
        import queue as queue_mod
        import threading

        self.inner, self.rate = inner, rate
        self.rank, self.size, self.scratch = inner.rank, inner.size, inner.scratch
        self.device = inner.device
        self._out_free = 0.0
        self._in_free = 0.0
        self._queue: Any = queue_mod.SimpleQueue()
        threading.Thread(target=self._sender, daemon=True).start()

    def _sender(self) -> None:
        while True:
            msg, box, ready = self._queue.get()
            tensor = msg[0]
            now = time.perf_counter()
            self._out_free = max(now, self._out_free) + tensor.numel() * tensor.element_size() / self.rate
            time.sleep(max(0.0, self._out_free - now))
            box.append(self.inner.start([msg])[0][0])
            ready.set()

    def start(self, sends: Any = (), recvs: Any = ()) -> tuple[list[Any], list[Any]]:
        return [self._send(m) for m in sends], [self._recv(m) for m in recvs]

    def _send(self, msg: Any) -> Any:
        import threading

        box: list[Any] = []
        ready = threading.Event()
        self._queue.put((msg, box, ready))

        class Pending:
            def wait(self) -> None:
                ready.wait()
                box[0].wait()

        return Pending()

    def _recv(self, msg: Any) -> Any:
        op, channel, tensor = self.inner.start((), [msg])[1][0], self, msg[0]

        class Held:
            def wait(self) -> None:
                op.wait()
                now = time.perf_counter()
                done = max(now, channel._in_free + tensor.numel() * tensor.element_size() / channel.rate)
                channel._in_free = done
                time.sleep(max(0.0, done - now))

        return Held()


def _paced_class(cls: type) -> type:
    class Paced(cls):  # type: ignore[misc, valid-type]
        def __init__(self, link_mbps: float, **kw: Any) -> None:
            super().__init__(**kw)
            self._rate = link_mbps * 1e6
            self._channel: Any = None

        def exchange(self, flat: Any, op: Any, ch: Any) -> None:
            if self._channel is None or self._channel.inner is not ch:
                self._channel = _PacedChannel(ch, self._rate)
            super().exchange(flat, op, self._channel)

    Paced.__name__ = f"Paced{cls.__name__}"
    return Paced


def measure(sizes: list[int], algorithms: list[str], rounds: int, budget_s: float,
            link_mbps: float | None, warm_every_size: bool = True) -> list[dict[str, Any]]:
    """Records of every (size, algorithm) on this job's ranks (run on every rank).

    ``warm_every_size=False`` warms up (buffers, channel, connections) at the first size
    only: on slow links a warm-up of a 64 MB allreduce costs seconds per algorithm, and
    the pass that counts how many operations fit the budget warms each size anyway."""
    import torch
    import torch.distributed as dist

    import ringtrain as rt

    n = rt.size()
    algs = {name: _algorithm(name, n, link_mbps) for name in algorithms}
    records = []
    for index, nbytes in enumerate(sizes):
        x = torch.randn(nbytes // 4)
        times: dict[str, list[float]] = {name: [] for name in algorithms}
        for name in algorithms if warm_every_size or index == 0 else ():  # warm up
            rt.allreduce_(x, rt.Sum, algorithm=algs[name])
        iters = {}
        for name in algorithms:  # how many ops fit in the budget (same on every rank)
            dist.barrier()
            t0 = time.perf_counter()
            rt.allreduce_(x, rt.Sum, algorithm=algs[name])
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            iters[name] = int(max(1, min(50, budget_s / max(t.item(), 1e-6))))
        for _ in range(rounds):
            for name in algorithms:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters[name]):
                    rt.allreduce_(x, rt.Sum, algorithm=algs[name])
                t = torch.tensor([(time.perf_counter() - t0) / iters[name]], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
                times[name].append(t.item())
        for name in algorithms:
            sec = statistics.median(times[name])
            algbw = nbytes / sec / 1e9
            records.append({
                "n": n, "bytes": nbytes, "algorithm": name, "seconds": sec, "time_s": sec,
                "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n,
                # Interference from other processes only adds time: the best round
                # estimates the uncontended cost.
                "best_s": min(times[name]), "all_s": times[name],
                "rounds": len(times[name]), "iters": iters[name],
            })
    return records


def compression_errors(algorithms: list[str], numel: int = 1 << 20) -> list[dict[str, Any]]:
    """Error of averaging with fp16 / bf16 on the wire, against the exact (float64) mean.

    Done the way DistributedOptimizer does it: each rank scales its float32 gradient by
    1/N, narrows it to the wire dtype, the ranks Sum-allreduce in that dtype, and the
    result is widened back. Gradients: Gaussian, standard deviation 1e-2 (typical
    magnitudes), a different stream per rank.
    """
    import torch

    import ringtrain as rt

    n, r = rt.size(), rt.rank()
    g = torch.Generator().manual_seed(1234 + r)
    grad = torch.randn(numel, generator=g) * 1e-2
    exact = rt.allreduce(grad.double(), rt.Average)
    scale = exact.abs().max().item()
    out = []
    for name in algorithms:
        alg = _algorithm(name, n, None)
        for wire in (torch.float32, torch.float16, torch.bfloat16):
            t = (grad / n).to(wire)
            rt.allreduce_(t, rt.Sum, algorithm=alg)
            err = (t.double() - exact).abs()
            out.append({
                "n": n, "algorithm": name, "wire": str(wire).replace("torch.", ""),
                "max_abs_err_rel": err.max().item() / scale,  # relative to the largest value
                "rms_rel": (err.norm() / exact.norm()).item(),
            })
    return out


def measure_all(sizes: list[int], algorithms: list[str], rounds: int, budget_s: float,
                link_mbps: float | None) -> dict[str, Any]:
    records = measure(sizes, algorithms, rounds, budget_s, link_mbps)
    errors = [] if link_mbps else compression_errors(algorithms)
    return {"records": records, "compression": errors}


def format_compression(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>2} {'algorithm':>9} {'wire':>8} {'max err / max |mean|':>21} {'rms err / rms mean':>19}"]
    for row in rows:
        lines.append(f"{row['n']:>2} {row['algorithm']:>9} {row['wire']:>8} "
                     f"{row['max_abs_err_rel']:21.2e} {row['rms_rel']:19.2e}")
    return "\n".join(lines)


# -- reporting (pure) ------------------------------------------------------------------

def human_bytes(n: int) -> str:
    for unit, shift in (("MB", 20), ("KB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def format_table(records: list[dict[str, Any]]) -> str:
    algs = list(dict.fromkeys(r["algorithm"] for r in records))
    by = {(r["n"], r["bytes"], r["algorithm"]): r for r in records}
    head = f"{'N':>2} {'size':>7} | " + " | ".join(f"{a:^27}" for a in algs)
    sub = f"{'':>2} {'':>7} | " + " | ".join(f"{'ms':>9} {'algbw':>8} {'busbw':>8}" for _ in algs)
    lines = [head, sub, "-" * len(sub)]
    for n, nbytes in sorted({(r["n"], r["bytes"]) for r in records}):
        cells = []
        for a in algs:
            r = by.get((n, nbytes, a))
            cells.append(f"{r['time_s'] * 1e3:9.3f} {r['algbw_GBps']:8.3f} {r['busbw_GBps']:8.3f}"
                         if r else f"{'-':>27}")
        lines.append(f"{n:>2} {human_bytes(nbytes):>7} | " + " | ".join(cells))
    lines.append("(ms: slowest rank's time per allreduce; algbw, busbw in GB/s, "
                 "busbw = algbw * 2(N-1)/N)")
    return "\n".join(lines)


def ratios(records: list[dict[str, Any]], min_bytes: int = 1 << 20) -> list[str]:
    """ring busbw / native busbw for sizes >= 1 MB, and time growth with N."""
    by = {(r["n"], r["bytes"], r["algorithm"]): r for r in records}
    out = []
    for n, nbytes in sorted({(r["n"], r["bytes"]) for r in records}):
        if nbytes >= min_bytes and (n, nbytes, "ring") in by and (n, nbytes, "native") in by:
            ring, native = by[(n, nbytes, "ring")], by[(n, nbytes, "native")]
            q = ring["busbw_GBps"] / native["busbw_GBps"]
            best = native.get("best_s", native["time_s"]) / ring.get("best_s", ring["time_s"])
            out.append(f"N={n} {human_bytes(nbytes)}: ring busbw / native busbw = {q:.2f} "
                       f"(median rounds), {best:.2f} (best rounds)")
    ns = sorted({r["n"] for r in records})
    for nbytes in sorted({r["bytes"] for r in records}):
        if nbytes < min_bytes or len(ns) < 2:
            continue
        for a in ("ring", "ps1", "psN", "native"):
            if all((n, nbytes, a) in by for n in ns):
                base = by[(ns[0], nbytes, a)]["time_s"]
                growth = ", ".join(f"N={n}: {by[(n, nbytes, a)]['time_s'] / base:.2f}x" for n in ns)
                out.append(f"{human_bytes(nbytes)} {a:>6} time vs N={ns[0]}: {growth}")
    return out


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["bytes"] for r in records if r["bytes"] >= 1 << 20}) or sorted({r["bytes"] for r in records})
    sizes = sizes[-3:]
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, nbytes in zip(axes[0], sizes, strict=True):
        for a in dict.fromkeys(r["algorithm"] for r in records):
            pts = sorted((r["n"], r["time_s"] * 1e3) for r in records
                         if r["bytes"] == nbytes and r["algorithm"] == a)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=a)
        ax.set_title(f"allreduce of {human_bytes(nbytes)}")
        ax.set_xlabel("processes N")
        ax.set_ylabel("ms per allreduce (slowest rank)")
        ax.set_xticks(sorted({r["n"] for r in records}))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    p.add_argument("--np", default="2,4,8", help="process counts, comma-separated")
    p.add_argument("--sizes", default=None, help="bytes, comma-separated (default 4 KB..64 MB)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--rounds", type=int, default=None, help="round-robin repetitions")
    p.add_argument("--budget", type=float, default=None, help="seconds per measurement")
    p.add_argument("--link-mbps", type=float, default=None,
                   help="pace ring/ps traffic to this many MB/s per rank and direction")
    p.add_argument("--shaped-hosts", default=None, metavar="N[,N...]",
                   help="one rank per network-namespace host, each with its own link shaped by "
                        "tc (needs root); N or a list, e.g. 2,3,4,6")
    p.add_argument("--link-mbit", type=float, default=200.0,
                   help="with --shaped-hosts: each host's link, Mbit/s per direction (default 200)")
    p.add_argument("--delay-ms", type=float, default=1.0,
                   help="with --shaped-hosts: added one-way delay per link (netem, or a delay "
                        "line where the kernel has none; default 1 ms)")
    p.add_argument("--netns-prefix", default="rtsh",
                   help="with --shaped-hosts: namespace names <prefix>1.. (default rtsh)")
    p.add_argument("--netns-subnet", default="10.213.70",
                   help="with --shaped-hosts: their /24, as a.b.c (default 10.213.70)")
    p.add_argument("--json", default=None, help="default out/bench_allreduce[_shaped].json")
    p.add_argument("--png", default=None, help="default out/bench_allreduce[_shaped].png")
    p.add_argument("--rank-job", help=argparse.SUPPRESS)  # one rank of a shaped-hosts job
    args = p.parse_args(argv)
    if args.rank_job:
        import allreduce_shaped

        return allreduce_shaped.rank_main(args.rank_job)
    if args.shaped_hosts:
        return _main_shaped(args)
    args.json = args.json if args.json is not None else "out/bench_allreduce.json"
    args.png = args.png if args.png is not None else "out/bench_allreduce.png"
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (QUICK_SIZES if args.quick else SIZES)
    algorithms = args.algorithms.split(",")
    if args.link_mbps:
        algorithms = [a for a in algorithms if a != "native"]  # Gloo's own sockets are not paced
    rounds = args.rounds or (2 if args.quick else 3)
    budget = args.budget or (0.1 if args.quick else 0.25)
    records: list[dict[str, Any]] = []
    compression: list[dict[str, Any]] = []
    cores = os.cpu_count() or 1
    for n in [int(x) for x in args.np.split(",")]:
        t0 = time.time()
        got = spawn_world(measure_all, n, sizes, algorithms, rounds, budget, args.link_mbps)[0]
        records += got["records"]
        compression += got["compression"]
        print(f"# N={n} measured in {time.time() - t0:.0f} s"
              + (f" ({n} processes on {cores} cores: oversubscribed)" if n > cores else ""),
              file=sys.stderr)
    import torch

    meta = {
        "host": platform.node(), "cores": cores, "torch": torch.__version__,
        "backend": "gloo", "link_mbps": args.link_mbps, "rounds": rounds, "budget_s": budget,
        "note": "N > cores means processes share cores (oversubscribed)",
    }
    print(format_table(records))
    for line in ratios(records):
        print(line)
    if compression:
        print("compression: averaging 1 M float32 gradients (std 1e-2) with the wire dtype")
        print(format_compression(compression))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"meta": meta, "records": records, "compression": compression}, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        link = f", links paced to {args.link_mbps:g} MB/s per rank" if args.link_mbps else ""
        over = max(r["n"] for r in records) > cores
        note = f"; N > {cores} shares the {cores} cores (oversubscribed)" if over else ""
        plot(records, Path(args.png), f"Gloo on {cores} cores, torch {torch.__version__}{link}{note}")
        print(f"wrote {args.png}")
    return 0


def _main_shaped(args: argparse.Namespace) -> int:
    import allreduce_shaped
    import shaped_hosts

    try:
        ns = [int(x) for x in args.shaped_hosts.split(",")]
        if min(ns) < 2:
            raise ValueError(f"--shaped-hosts needs N >= 2, got {args.shaped_hosts}")
    except ValueError as exc:
        print(f"allreduce.py: {exc}", file=sys.stderr)
        return 2
    reason = shaped_hosts.requirements()
    if reason:
        print(f"allreduce.py: --shaped-hosts: {reason}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else allreduce_shaped.SIZES
    rounds = args.rounds or (1 if args.quick else 3)
    budget = args.budget or 0.25
    try:
        records, meta = allreduce_shaped.run_shaped(ns, args.link_mbit, args.delay_ms, sizes,
                                                    args.algorithms.split(","), rounds, budget,
                                                    prefix=args.netns_prefix, subnet=args.netns_subnet)
    except shaped_hosts.ShapedHostsError as exc:
        print(f"allreduce.py: --shaped-hosts: {exc}", file=sys.stderr)
        return 1
    print(allreduce_shaped.format_shaped(records, args.link_mbit))
    for line in allreduce_shaped.growth_lines(records) + allreduce_shaped.summary(records):
        print(line)
    json_path = Path(args.json or "out/bench_allreduce_shaped.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for rec in records:
        rec["meta"] = meta  # a list of self-describing records
    json_path.write_text(json.dumps(records, indent=1))
    print(f"wrote {json_path}")
    png = Path(args.png or "out/bench_allreduce_shaped.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(records, png, f"{max(ns)} namespace hosts, {meta['qdisc']}, Gloo, torch {meta['torch']}")
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
