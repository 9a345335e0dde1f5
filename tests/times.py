"""Measure where the suite's time goes, per test file, and keep docs/testing.md current.

    python tests/times.py --tier fast --hog --write      # what `make test-times` runs
    python tests/times.py --tier system -- -x            # args after -- go to pytest
    python tests/times.py --tier system --from DIR --write   # read a run measured elsewhere

Runs pytest on one tier (``fast``: ``-m "not system"``, what ``make test`` runs;
``system``: ``-m system``; ``all``) with ``tests/timing.py`` switched on, optionally
beside a busy loop (``--hog``, as CI's loaded machine), and prints one row per test
file: tests, wall seconds, CPU seconds of every process the tests started (from a
cgroup, when this machine lets us make one), Python interpreters started, idle seconds
(the wall time the test's processes left unused on the cores they could have had:
``wall - cpu / (cores - the hog's share)``) and seconds the pytest process slept.
``--write`` replaces the tier's table in docs/testing.md.

``--from DIR`` reads the records of a run that was measured without this script, such
as a whole ``bash .ci/run`` (both tiers in one run): start it with ``RINGTEST_TIMES=
DIR/records.jsonl``, ``RINGTEST_STARTS=DIR/starts.txt``, ``tests/timing_site`` on
``PYTHONPATH`` and, for the CPU columns, ``RINGTEST_CGROUP`` (a cgroup's CPU counter file,
the run inside that cgroup) and ``RINGTEST_HOG_PID`` (the busy loop beside it, outside).
Each record says whether its test is in the system tier, so one run gives both tables.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "docs" / "testing.md"
TIERS = {"fast": "not system", "system": "system", "all": ""}


def make_cgroup() -> tuple[Path | None, str]:
    """A fresh CPU-accounting cgroup (its directory, its counter file), or (None, "")."""
    name = f"ringtest-{os.getpid()}"
    for base, counter in ((Path("/sys/fs/cgroup/cpuacct"), "cpuacct.usage"),
                          (Path("/sys/fs/cgroup/unified"), "cpu.stat"),
                          (Path("/sys/fs/cgroup"), "cpu.stat")):
        if not (base / counter).exists() and not (base / "cgroup.procs").exists():
            continue
        try:
            (base / name).mkdir(exist_ok=True)
        except OSError:
            continue
        if (base / name / counter).exists():
            return base / name, str(base / name / counter)
        (base / name).rmdir()
    return None, ""


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def in_tier(records: list[dict], starts: list[str], tier: str) -> tuple[list[dict], list[str]]:
    """The records (and interpreter starts) of one tier's tests."""
    if tier == "all":
        return records, starts
    keep = {r["nodeid"] for r in records if r.get("system", False) == (tier == "system")}
    return [r for r in records if r["nodeid"] in keep], [s for s in starts if s in keep]


def aggregate(records: list[dict], starts: list[str], cores: int) -> list[dict]:
    per: dict[str, dict] = collections.defaultdict(
        lambda: {"tests": 0, "wall": 0.0, "cpu": 0.0, "hog": 0.0, "sleep": 0.0, "starts": 0, "idle": 0.0})
    for r in records:
        row = per[file_of(r["nodeid"])]
        row["tests"] += 1
        for key in ("wall", "cpu", "hog", "sleep"):
            row[key] += r[key]
        # the cores this test could have had: all of them but what the busy loop took
        usable = max(1.0, cores - (r["hog"] / r["wall"] if r["wall"] > 0 else 0.0))
        row["idle"] += max(0.0, r["wall"] - r["cpu"] / usable) if r["cpu"] > 0 else 0.0
    for line in starts:
        if line:
            per[file_of(line)]["starts"] += 1
    rows = [{"file": f, **v} for f, v in per.items() if v["tests"]]
    return sorted(rows, key=lambda r: -r["wall"])


def table(rows: list[dict], have_cpu: bool) -> str:
    head = "| file | tests | wall s | CPU s | Python starts | idle s | sleep s |\n|---|--:|--:|--:|--:|--:|--:|\n"
    total = {k: sum(r[k] for r in rows) for k in ("tests", "wall", "cpu", "starts", "idle", "sleep")}
    out = []
    for r in [*rows, {"file": "**total**", **total}]:
        cpu = f"{r['cpu']:.1f}" if have_cpu else "n/a"
        idle = f"{r['idle']:.1f}" if have_cpu else "n/a"
        out.append(f"| {r['file']} | {r['tests']} | {r['wall']:.1f} | {cpu} | {r['starts']} | {idle} | "
                   f"{r['sleep']:.1f} |")
    return head + "\n".join(out) + "\n"


def write_doc(tier: str, text: str) -> None:
    begin, end = f"<!-- times:{tier} -->", f"<!-- /times:{tier} -->"
    doc = DOC.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"docs/testing.md has no {begin} ... {end} section to replace; add the two markers")
    head, rest = doc.split(begin, 1)
    DOC.write_text(head + begin + "\n" + text + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=sorted(TIERS), default="fast")
    parser.add_argument("--hog", action="store_true", help="run a busy loop beside the suite, as CI's load")
    parser.add_argument("--write", action="store_true", help="replace the tier's table in docs/testing.md")
    parser.add_argument("--from", dest="source", type=Path, metavar="DIR",
                        help="read records.jsonl and starts.txt of a run measured elsewhere (see above)")
    parser.add_argument("--note", default="", help="with --from: how that run was made (goes under the table)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)

    if args.source is not None:
        return report(args, args.source, None, args.note or "measured elsewhere")
    work = Path(tempfile.mkdtemp(prefix="ringtest-times-"))
    records_path, starts_path = work / "records.jsonl", work / "starts.txt"
    cgroup, counter = make_cgroup()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None
    env = dict(os.environ, RINGTEST_TIMES=str(records_path), RINGTEST_STARTS=str(starts_path),
               RINGTEST_CGROUP=counter, RINGTEST_HOG_PID=str(hog.pid if hog else 0),
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE / "timing_site"),
                                                         os.environ.get("PYTHONPATH", "")])))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    if TIERS[args.tier]:
        command += ["-m", TIERS[args.tier]]
    command += args.pytest_args

    def join_cgroup() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    t0 = time.monotonic()
    try:
        code = subprocess.call(command, cwd=ROOT, env=env, preexec_fn=join_cgroup)
    finally:
        elapsed = time.monotonic() - t0
        if hog is not None:
            hog.kill()
            hog.wait()
        if cgroup is not None:
            try:
                cgroup.rmdir()
            except OSError:
                pass  # a process of the suite still in it; the empty group goes at reboot
    how = (f"{'beside a busy loop' if args.hog else 'quiet'}, {os.cpu_count()} cores: pytest exited "
           f"{code} after {elapsed:.0f} s wall")
    # no records (e.g. a collection error: pytest's output says what): its code stands
    return code if report(args, work, counter, how) == 0 else code or 1


def report(args: argparse.Namespace, work: Path, counter: str | None, how: str) -> int:
    """Print (and with --write, put in docs/testing.md) the tier's table from work's records."""
    records_path, starts_path = work / "records.jsonl", work / "starts.txt"
    if not records_path.exists():
        print(f"{records_path} does not exist: start the run with RINGTEST_TIMES={records_path} "
              "(see tests/times.py's --from)", file=sys.stderr)
        return 1
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line]
    if not records:
        print(f"no test records in {records_path} ({how}): no table", file=sys.stderr)
        return 1
    starts = starts_path.read_text().splitlines() if starts_path.exists() else []
    records, starts = in_tier(records, starts, args.tier)
    # a run measured elsewhere had CPU columns if any test saw its cgroup's counter move
    have_cpu = bool(counter) if counter is not None else any(r["cpu"] > 0 for r in records)
    text = table(aggregate(records, starts, os.cpu_count() or 1), have_cpu=have_cpu)
    summary = f"\n{args.tier} tier, {how} ({time.strftime('%Y-%m-%d')}).\n"
    print(text + summary)
    if args.write:
        write_doc(args.tier, text + summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
