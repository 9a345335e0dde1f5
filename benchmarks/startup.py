"""Time from launcher start to the first training step: ringrun vs torchrun.

    python benchmarks/startup.py                 # N = 2 and 4, 5 rounds each
    python benchmarks/startup.py --hosts         # also ringrun over 2 namespace hosts (root)

Every launcher runs the same script (tests/hosts/train_tiny.py, 5 steps), which prints
the wall-clock time just before its first step on rank 0; the time from starting the
launcher process to that line is the start-up cost (interpreter starts, torch imports,
rendezvous, process group, resume check). Launchers take turns within each round
(median of the rounds), so background load hits all alike; compare them as ratios
within one run, never absolute times across machines.

Variants:
- ``ringrun``: the installed entry point as it is.
- ``ringrun (lazy pkg)``: the same launcher code, with the ``ringtrain`` package not
  importing torch at import time; what ringrun costs once ``ringtrain/__init__`` loads
  its submodules lazily (the launcher itself never needs torch).
- ``torchrun``: ``torchrun --standalone --nproc-per-node N``.
- ``ringrun 2 hosts``: ``-H h1:N/2,h2:N/2`` over ssh to the test namespaces (``--hosts``).

Outputs: a table on stdout and JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tests" / "hosts" / "train_tiny.py"
BIN = Path(sys.executable).parent
LAZY = (
    "import sys, types; m = types.ModuleType('ringtrain'); "
    f"m.__path__ = [{str(ROOT / 'src' / 'ringtrain')!r}]; sys.modules['ringtrain'] = m; "
    "from ringtrain.launch.cli import main; sys.exit(main())"
)


def _launchers(n: int, hosts: list[str]) -> dict[str, list[str]]:
    found = {
        # torchrun starts any number of processes; compare like with like.
        "ringrun": [str(BIN / "ringrun"), "-np", str(n), "--oversubscribe"],
        "ringrun (lazy pkg)": [sys.executable, "-c", LAZY, "-np", str(n), "--oversubscribe"],
        "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(n)],
    }
    if hosts:
        state = Path(os.environ.get("RT_NETNS_STATE", "/tmp/ringtrain-netns"))
        per = n // 2
        found["ringrun 2 hosts"] = [
            str(BIN / "ringrun"), "-np", str(n), "-H", f"{hosts[0]}:{per},{hosts[1]}:{per}",
            "-i", str(state / "id_ed25519"), "--ssh-option",
            f"UserKnownHostsFile={state / 'known_hosts'}",
        ]
    return found


def _one(argv: list[str], workdir: Path) -> float:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    script = ["python", str(TRAIN)] if "torchrun" not in argv[0] else [str(TRAIN)]
    args = [*script, "--steps", "5", "--every", "1000", "--checkpoint-dir", str(workdir / "ck"),
            "--out", str(workdir / "out.pt")]
    start = time.time()
    res = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{argv[0]} failed: {res.stderr[-1500:]}")
    for line in res.stdout.splitlines():
        if "first step at " in line:
            return float(line.rsplit(" ", 1)[1]) - start
    raise SystemExit(f"no 'first step' line from {argv[0]}: {res.stdout[-500:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--nprocs", default="2,4")
    p.add_argument("--hosts", action="store_true", help="also ringrun over 2 namespace hosts")
    p.add_argument("--json", default="runs/bench/startup.json")
    args = p.parse_args(argv)
    hosts: list[str] = []
    if args.hosts:
        subprocess.run(["bash", str(ROOT / "tests/hosts/setup_netns.sh"), "2"], check=True,
                       capture_output=True)
        hosts = ["10.213.57.11", "10.213.57.12"]
    results: dict[str, dict[str, float]] = {}
    for n in (int(x) for x in args.nprocs.split(",")):
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, launcher in _launchers(n, hosts).items():
                with tempfile.TemporaryDirectory() as d:
                    times.setdefault(name, []).append(_one(launcher, Path(d)))
        results[str(n)] = {name: statistics.median(v) for name, v in times.items()}
    names = list(next(iter(results.values())))
    print(f"{'processes':>9} | " + " | ".join(f"{n:>18}" for n in names) + " | ringrun/torchrun")
    for n, row in results.items():
        ratio = row["ringrun"] / row["torchrun"]
        print(f"{n:>9} | " + " | ".join(f"{row[k]:>17.2f}s" for k in names) + f" | {ratio:.2f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seconds_to_first_step_median": results, "rounds": args.rounds,
                               "machine": platform.platform(), "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
