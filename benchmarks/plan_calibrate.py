"""Calibrate the planner on this machine: loopback Gloo alpha/B, then predict vs measure.

    python benchmarks/plan_calibrate.py [--procs 2,4] [--steps 12] [--json out/plan_calibrate.json]
    python benchmarks/plan_calibrate.py --shaped-hosts 2,3,4 --link-mbit 200     # as root

Prints the table of ``ringtrain plan --calibrate`` and writes the numbers as JSON.
Absolute times drift between runs on shared machines; compare predicted with measured
within one run.

``--shaped-hosts`` runs ``ringtrain plan --calibrate`` as the ranks of a job on N
network-namespace hosts whose links are shaped by tc (``shaped_hosts.py``): each job fits
alpha and B on its own links and predicts its own step. The runs then cross-check the
fit: alpha and B of the smallest N predict the step at every other N (from that job's
own step without exchange).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from ringtrain.errors import RingtrainError
from ringtrain.plan.calibrate import (
    Fit,
    SweepPoint,
    fit_alpha_beta,
    format_calibration,
    mnist_cnn,
    predict_step,
    run_calibration,
)


def _shaped(ns: list[int], mbit: float, delay_ms: float) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import shaped_hosts

    ringtrain_cli = str(Path(sys.executable).parent / "ringtrain")
    hosts = shaped_hosts.build(max(ns), mbit, delay_ms)
    runs: dict[int, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ringtrain-calibrate-") as tmp:
            for n in ns:
                out = f"{tmp}/cal-{n}.json"
                texts = shaped_hosts.launch(hosts, [ringtrain_cli, "plan", "--calibrate", "--json", out],
                                            n=n, timeout_s=900)
                print(texts[0])
                runs[n] = json.loads(Path(out).read_text())
    finally:
        shaped_hosts.teardown(hosts)
    return {"link_mbit": mbit, "delay_ms": hosts.delay_ms, "qdisc": hosts.qdisc, "runs": runs,
            "cross": _cross(runs, mbit)}


def _cross(runs: dict[int, dict[str, Any]], mbit: float) -> list[dict[str, Any]]:
    """The smallest N's fit predicts every N's step (from that run's own compute)."""
    from ringtrain.plan.layers import from_module

    base = min(runs)
    raw = runs[base]["fit"]
    fit = Fit(raw["alpha_s"], raw["bandwidth"], raw["rms_rel_error"])
    layers = from_module(mnist_cnn())
    rows = []
    for n, run in sorted(runs.items()):
        check = run["checks"][0]
        # single_step_s of a job's calibration is its in-run step without exchange.
        _, predicted = predict_step(layers, fit, n, run["single_step_s"], cores=run["cores"],
                                    cv=run["single_step_cv"], shared=False, link_on_cpu=False)
        own = fit_alpha_beta([SweepPoint(**p) for p in run["sweep"]])
        rows.append({"n": n, "fit_from": base, "predicted_s": predicted, "measured_s": check["measured_s"],
                     "error": (predicted - check["measured_s"]) / check["measured_s"],
                     "own_fit_error": check["inworld_error"], "own_B_over_link": own.bandwidth * 8 / (mbit * 1e6),
                     "own_alpha_s": own.alpha_s})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", default="2,4", help="process counts to check (default 2,4)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per process count (local)")
    p.add_argument("--shaped-hosts", default=None, metavar="N[,N...]",
                   help="calibrate as the ranks of jobs on N shaped network-namespace hosts (root)")
    p.add_argument("--link-mbit", type=float, default=200.0, help="with --shaped-hosts: link rate")
    p.add_argument("--delay-ms", type=float, default=1.0,
                   help="with --shaped-hosts: added one-way delay per link (default 1 ms)")
    p.add_argument("--json", default=None, help="default out/plan_calibrate[_shaped].json")
    args = p.parse_args(argv)
    if args.shaped_hosts:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import shaped_hosts

        reason = shaped_hosts.requirements()
        if reason:
            print(f"plan_calibrate: --shaped-hosts: {reason}", file=sys.stderr)
            return 2
        try:
            result = _shaped([int(x) for x in args.shaped_hosts.split(",")], args.link_mbit,
                             args.delay_ms)
        except (ValueError, shaped_hosts.ShapedHostsError) as exc:
            print(f"plan_calibrate: {exc}", file=sys.stderr)
            return 1
        print(f"\n{result['qdisc']}: fit of the smallest N, predicting every N")
        print(" N  fit from  predicted ms  measured ms   error | own fit: error  B / link  alpha us")
        for row in result["cross"]:
            print(f"{row['n']:2d} {row['fit_from']:9d} {row['predicted_s'] * 1e3:13.1f} "
                  f"{row['measured_s'] * 1e3:12.1f} {100 * row['error']:+7.1f}% | "
                  f"{100 * row['own_fit_error']:+13.1f}% {row['own_B_over_link']:9.2f} "
                  f"{row['own_alpha_s'] * 1e6:9.0f}")
        worst = max(abs(r["own_fit_error"]) for r in result["cross"])
        print(f"largest error of a job's own prediction: {100 * worst:.1f}%; median over the "
              f"cross-predictions: {100 * statistics.median(abs(r['error']) for r in result['cross']):.1f}%")
        out = Path(args.json or "out/plan_calibrate_shaped.json")
    else:
        try:
            worlds = tuple(int(x) for x in args.procs.split(","))
            cal = run_calibration(worlds, steps=args.steps)
        except (ValueError, RingtrainError) as exc:
            print(f"plan_calibrate: {exc}", file=sys.stderr)
            return 2
        print(format_calibration(cal))
        result = cal.to_json()
        out = Path(args.json or "out/plan_calibrate.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
