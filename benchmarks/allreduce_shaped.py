"""The allreduce benchmark on shaped links: one rank per host, each host its own tc-shaped NIC.

    python benchmarks/allreduce.py --shaped-hosts 2,3,4,6 --link-mbit 200 --json out/shaped.json

(as root). On loopback every rank copies through the same memory bus and cores, so all
algorithms slow down alike as N grows; here each rank's traffic goes through its own
link of ``--link-mbit`` Mbit/s in each direction (``benchmarks/shaped_hosts.py``), the
kernel's real TCP path, so the traffic pattern of each algorithm sets its time:

=========  ==========================================  ===========================
algorithm  bytes through the busiest link, per dir.    time relative to N = 2
=========  ==========================================  ===========================
ring       2(N-1)/N x S                                2(N-1)/N: 1, 1.33, 1.5, 1.67
psN        2(N-1)/N x S (each rank serves 1/N)         the same as the ring
ps1        (N-1) x S (the server's link)               N-1: 1, 2, 3, 5
native     Gloo's own allreduce (a ring on CPUs)       about the ring's
=========  ==========================================  ===========================

busbw = S / t x 2(N-1)/N is the rate each link runs at for a bandwidth-optimal
allreduce, so ring, psN and native should reach the link rate; ps1's busbw falls as
2/N of it (its one link carries N-1 times the buffer).

Every N is one job of N ranks started in the first N hosts (the hosts are built once for
the largest N); rank 0 writes the records of its job to a file the parent reads. The
JSON output is a list of records, each with ``algorithm`` (native, ring, ps1, psN),
``n``, ``bytes``, ``seconds`` (median of the rounds), busbw and the link it ran on.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import shaped_hosts

__all__ = ["SIZES", "theory", "run_shaped", "rank_main", "format_shaped", "growth_lines"]

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]


def theory(algorithm: str, n: int) -> float:
    """Bytes through the busiest link per direction, in units of the buffer (see the doc)."""
    return float(n - 1) if algorithm == "ps1" else 2 * (n - 1) / n


def rank_main(job_file: str) -> int:
    """One rank's part, run inside its namespace: measure, rank 0 writes the records."""
    from allreduce_measure import measure

    import ringtrain as rt

    job = json.loads(Path(job_file).read_text())
    import torch

    torch.set_num_threads(1)
    rt.init()
    try:
        records = measure(job["sizes"], job["algorithms"], job["rounds"], job["budget"], None,
                          warm_every_size=False)
        if rt.rank() == 0:
            Path(job["out"]).write_text(json.dumps(records))
    finally:
        rt.shutdown()
    return 0


def run_shaped(ns: list[int], mbit: float, delay_ms: float, sizes: list[int], algorithms: list[str],
               rounds: int, budget: float, timeout_s: float = 3600, prefix: str = shaped_hosts.PREFIX,
               subnet: str = shaped_hosts.SUBNET) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Build the hosts, run one job per N, tear the hosts down; (records, meta)."""
    hosts = shaped_hosts.build(max(ns), mbit, delay_ms, prefix=prefix, subnet=subnet)
    records: list[dict[str, Any]] = []
    try:
        probe = shaped_hosts.probe_rate(hosts) if hosts.n > 1 else float("nan")
        rtt = shaped_hosts.probe_rtt(hosts) if hosts.n > 1 else [float("nan")]
        print(f"# {hosts.n} hosts, {hosts.qdisc}; one TCP stream host1 -> host2 carries "
              f"{probe:.1f} Mbit/s of payload ({probe / mbit:.2f} of the link); round trip "
              f"host1 -> host2 median {rtt[len(rtt) // 2]:.2f} ms (min {rtt[0]:.2f})", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="ringtrain-shaped-") as tmp:
            os.chmod(tmp, 0o755)
            for n in ns:
                t0 = time.time()
                job = {"sizes": sizes, "algorithms": [a for a in algorithms if a != "psN" or n > 1],
                       "rounds": rounds, "budget": budget, "out": f"{tmp}/records-{n}.json"}
                Path(f"{tmp}/job-{n}.json").write_text(json.dumps(job))
                here = str(Path(__file__).resolve().parent / "allreduce.py")
                shaped_hosts.launch(hosts, [sys.executable, here, "--rank-job", f"{tmp}/job-{n}.json"],
                                    n=n, timeout_s=timeout_s)
                got = json.loads(Path(job["out"]).read_text())
                for rec in got:
                    rec["busbw_link"] = rec["busbw_GBps"] * 1e9 * 8 / (mbit * 1e6)
                    rec.update(link_mbit=mbit, delay_ms=hosts.delay_ms, transport="shaped-veth")
                records += got
                print(f"# N={n} measured in {time.time() - t0:.0f} s", file=sys.stderr)
    finally:
        shaped_hosts.teardown(hosts)
    import torch

    meta = {"host": platform.node(), "cores": os.cpu_count() or 1, "torch": torch.__version__,
            "backend": "gloo", "link_mbit": mbit, "delay_ms": hosts.delay_ms, "qdisc": hosts.qdisc,
            "probe_mbit": probe, "rtt_ms_median": rtt[len(rtt) // 2], "rtt_ms_min": rtt[0],
            "rounds": rounds, "budget_s": budget}
    for rec in records:
        rec.setdefault("qdisc", hosts.qdisc)
    return records, meta


def _mb(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MB"


def format_shaped(records: list[dict[str, Any]], mbit: float) -> str:
    """N x size x algorithm: ms, busbw in MB/s and busbw / link rate."""
    algs = list(dict.fromkeys(r["algorithm"] for r in records))
    by = {(r["n"], r["bytes"], r["algorithm"]): r for r in records}
    head = f"{'N':>2} {'size':>6} | " + " | ".join(f"{a:^24}" for a in algs)
    sub = f"{'':>2} {'':>6} | " + " | ".join(f"{'ms':>8} {'MB/s':>7} {'/link':>7}" for _ in algs)
    lines = [head, sub, "-" * len(sub)]
    for n, nbytes in sorted({(r["n"], r["bytes"]) for r in records}):
        cells = []
        for a in algs:
            r = by.get((n, nbytes, a))
            cells.append(f"{r['seconds'] * 1e3:8.0f} {r['busbw_GBps'] * 1e3:7.2f} {r['busbw_link']:7.2f}"
                         if r else f"{'-':>24}")
        lines.append(f"{n:>2} {_mb(nbytes):>6} | " + " | ".join(cells))
    lines.append(f"(ms: slowest rank's median time per allreduce; MB/s: busbw = S/t x 2(N-1)/N; "
                 f"/link: busbw over the {mbit:g} Mbit/s = {mbit / 8:g} MB/s link)")
    return "\n".join(lines)


def growth_lines(records: list[dict[str, Any]]) -> list[str]:
    """Time at N over time at the smallest N, measured and in theory."""
    by = {(r["n"], r["bytes"], r["algorithm"]): r for r in records}
    ns = sorted({r["n"] for r in records})
    out = []
    if len(ns) < 2:
        return out
    for nbytes in sorted({r["bytes"] for r in records}):
        for a in dict.fromkeys(r["algorithm"] for r in records):
            if not all((n, nbytes, a) in by for n in ns):
                continue
            base = by[(ns[0], nbytes, a)]["seconds"]
            cells = [f"N={n}: {by[(n, nbytes, a)]['seconds'] / base:.2f} "
                     f"({theory(a, n) / theory(a, ns[0]):.2f})" for n in ns[1:]]
            out.append(f"{_mb(nbytes):>6} {a:>6} time vs N={ns[0]} (theory): " + ", ".join(cells))
    return out


def summary(records: list[dict[str, Any]]) -> list[str]:
    """The claims in one place: busbw of the bandwidth-optimal algorithms vs the link."""
    big = [r for r in records if r["bytes"] >= 4 << 20 and r["algorithm"] in ("ring", "psN", "native")]
    out = []
    for a in ("ring", "psN", "native"):
        vals = [r["busbw_link"] for r in big if r["algorithm"] == a]
        if vals:
            out.append(f"{a:>6}: busbw / link rate for >= 4 MB: min {min(vals):.2f}, median "
                       f"{statistics.median(vals):.2f}, max {max(vals):.2f} over {len(vals)} cells")
    return out
