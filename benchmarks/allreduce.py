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
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from allreduce_measure import measure_all
from local_job import spawn_world

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
ALGORITHMS = ["native", "ring", "ps1", "psN"]


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
