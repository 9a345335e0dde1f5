"""How long horovodrun's elastic steps take on this machine: grow, shrink, a failed rank's
host blacklisted, and a blacklisted host coming back.

    python benchmarks/elastic_steps.py [--rounds 3] [--hog] [--write docs/launch.md]

Each round runs three jobs of tests/integration/scripts/hvd_elastic_scenarios.py (4 ranks
at most, ``localhost`` and ``127.0.0.1`` as the two hosts, as Horovod's elastic tests
run): hosts added then removed, a rank failing, and a host failing, coming back after
``--blacklist-cooldown-range 1 2`` and failing again. ringrun's stderr lines are stamped
as they arrive, and each step is the time between two of them:

- grow: ringrun takes the new host (at most a discovery round, 1 s, after the script
  lists it) -> the larger world has formed (its ranks started, loaded torch, joined at
  the next commit);
- shrink: ringrun writes the world without the host the script dropped -> formed;
- failure: ringrun sees the failed rank's exit -> the smaller world, without the rank's
  host, has formed;
- back: the cooldown ran out -> the larger world has formed again.

Medians and ranges over the rounds; ``--hog`` runs a busy loop beside (as CI's loaded
machine). ``--write`` replaces the table between the ``elastic-timings`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "integration" / "scripts" / "hvd_elastic_scenarios.py"
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")


def _discovery(tmp: Path, log: Path, schedule: list[list[str]]) -> str:
    lines = ["#!/bin/sh", f'n=$(cat "{log}" 2>/dev/null | wc -l)']
    for i, hosts in enumerate(schedule):
        body = "; ".join(f"echo {h}" for h in hosts)
        if i < len(schedule) - 1:
            lines.append(f'{"if" if i == 0 else "elif"} [ "$n" -lt {i + 1} ]; then {body}')
        else:
            lines.append(f"{'else' if i else 'if true; then'} {body}")
    lines.append("fi")
    path = tmp / "discover.sh"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return str(path)


def _job(flags: list[str], args: list[str], schedule: list[list[str]]) -> list[tuple[float, str]]:
    """Run one job; ringrun's stderr lines with the second each arrived."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        log = tmp / "log.jsonl"
        cmd = [HOROVODRUN, *flags, "--host-discovery-script", _discovery(tmp, log, schedule),
               "python", str(SCRIPT), str(log), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=d)
        lines: list[tuple[float, str]] = []
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))
        if proc.wait(timeout=300) != 0:
            raise SystemExit(f"job failed: {' '.join(cmd)}\n" + "\n".join(t for _, t in lines[-20:]))
        sizes = [json.loads(x)["size"] for x in log.read_text().splitlines()]
    return lines + [(0.0, f"sizes {sizes}")]


def _between(lines: list[tuple[float, str]], start: str, end: str, nth: int = 0) -> float:
    """Seconds from the nth line matching ``start`` to the first after it matching ``end``."""
    starts = [i for i, (_, t) in enumerate(lines) if re.search(start, t)]
    i = starts[nth]
    j = next(j for j in range(i + 1, len(lines)) if re.search(end, lines[j][1]))
    return lines[j][0] - lines[i][0]


def one_round() -> dict[str, float]:
    both = ["localhost:2", "127.0.0.1:2"]
    out: dict[str, float] = {}
    lines = _job(["-np", "2", "--min-np", "2", "--max-np", "4"], ["--wait-for-hosts-after", "0,1"],
                 [["localhost:2"], both, ["127.0.0.1:2"]])
    out["grow"] = _between(lines, r"host 127\.0\.0\.1 added", r"world 1 formed")
    out["shrink"] = _between(lines, r"no longer lists localhost", r"world 2 formed")
    lines = _job(["-np", "2", "--min-np", "2", "--max-np", "4"], ["--exit-at", "1,0:0", "--exit-mode", "kill"],
                 [both])
    out["failure"] = _between(lines, r"worker 0 .*killed", r"world 1 formed")
    lines = _job(["-np", "2", "--min-np", "2", "--max-np", "4", "--blacklist-cooldown-range", "1", "2"],
                 ["--epochs", "6", "--exit-at", "1,0:3;4,0:3", "--wait-for-hosts-after", "2"], [both])
    out["failure_host"] = _between(lines, r"worker 3 .*exited", r"world 1 formed")
    out["back"] = _between(lines, r"127\.0\.0\.1 is no longer blacklisted", r"world 2 formed")
    return out


STEPS = [("grow", "grow: ringrun takes the listed host -> the larger world formed (its ranks started, "
                  "imported torch, joined at the next commit)"),
         ("shrink", "shrink: host dropped by the script -> the smaller world formed"),
         ("failure", "a rank SIGKILLed -> the world without its host formed"),
         ("failure_host", "a rank raised -> the world without its host formed"),
         ("back", "cooldown over -> the host's new ranks joined, world formed")]


def table(rounds: list[dict[str, float]], note: str) -> str:
    lines = [f"{note}\n", "| step | median s | range s |", "|---|---|---|"]
    for key, text in STEPS:
        xs = [r[key] for r in rounds]
        lines.append(f"| {text} | {statistics.median(xs):.2f} | {min(xs):.2f}-{max(xs):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hog", action="store_true", help="a busy loop beside the jobs")
    p.add_argument("--write", help="replace the table between <!-- elastic-timings --> markers")
    args = p.parse_args()
    stop = threading.Event()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None
    try:
        rounds = []
        for i in range(args.rounds):
            rounds.append(one_round())
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in rounds[-1].items()), flush=True)
    finally:
        stop.set()
        if hog is not None:
            hog.kill()
    load = os.getloadavg()[0]
    note = (f"Measured with benchmarks/elastic_steps.py: {args.rounds} rounds on this 2-core machine"
            f"{' beside a busy loop' if args.hog else ''} (load average {load:.1f} at the end); "
            "ringrun's stderr lines stamped as they arrived.")
    text = table(rounds, note)
    print(text)
    if args.write:
        doc = Path(args.write)
        body = doc.read_text()
        new = re.sub(r"(<!-- elastic-timings -->\n).*?(<!-- /elastic-timings -->)",
                     lambda m: m.group(1) + text + m.group(2), body, flags=re.S)
        doc.write_text(new)


if __name__ == "__main__":
    main()
