"""Calibrate the planner on this machine: loopback Gloo alpha/B, then predict vs measure.

    python benchmarks/plan_calibrate.py [--procs 2,4] [--steps 12] [--json out/plan_calibrate.json]

Prints the table of ``ringtrain plan --calibrate`` and writes the numbers as JSON.
Absolute times drift between runs on shared machines; compare predicted with measured
within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ringtrain.errors import RingtrainError
from ringtrain.plan.calibrate import format_calibration, run_calibration


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", default="2,4", help="process counts to check (default 2,4)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per process count")
    p.add_argument("--json", default="out/plan_calibrate.json", help="where to write the results")
    args = p.parse_args(argv)
    try:
        worlds = tuple(int(x) for x in args.procs.split(","))
        cal = run_calibration(worlds, steps=args.steps)
    except (ValueError, RingtrainError) as exc:
        print(f"plan_calibrate: {exc}", file=sys.stderr)
        return 2
    print(format_calibration(cal))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(cal.to_json(), indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
