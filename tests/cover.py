"""Line coverage of src/ringtrain by the test suite, per tier and both together.

    python tests/cover.py                  # both tiers (root, as CI), what `make coverage` runs
    python tests/cover.py --tiers fast     # the fast tier alone

Every Python process the tests start is measured: ranks forked by tests/ringtest.py's
fork server (coverage's multiprocessing support), ringrun and its workers, scripts run
with subprocess (coverage's ``patch = subprocess``), and processes that leave through
``os._exit``. Processes that sshd or slurmd start on the test hosts are not (they do not
inherit the environment that switches coverage on). Needs coverage >= 7.10.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TIERS = {"fast": "not system", "system": "system"}
CONFIG = """\
[run]
source = ringtrain
parallel = true
concurrency = multiprocessing, thread
patch = subprocess, _exit, fork
data_file = {data}
"""


def run_tier(tier: str, work: Path, pytest_args: list[str]) -> int:
    rc = work / f"{tier}.coveragerc"
    rc.write_text(CONFIG.format(data=work / tier / ".coverage"))
    (work / tier).mkdir()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    code = subprocess.call([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-q",
                            "-p", "no:cacheprovider", "-m", TIERS[tier], "tests", *pytest_args],
                           cwd=ROOT, env=env)
    subprocess.call([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "-q"], cwd=ROOT)
    return code


def percent(work: Path, tiers: list[str]) -> str:
    rc = work / "report.coveragerc"
    rc.write_text(CONFIG.format(data=work / "all.coverage"))
    files = [str(work / t / ".coverage") for t in tiers]
    subprocess.call([sys.executable, "-m", "coverage", "combine", f"--rcfile={rc}", "--keep", "-q", *files],
                    cwd=ROOT)
    out = subprocess.run([sys.executable, "-m", "coverage", "report", f"--rcfile={rc}", "--format=total",
                          "--precision=1"], cwd=ROOT, capture_output=True, text=True)
    (work / "all.coverage").unlink(missing_ok=True)
    return out.stdout.strip() or out.stderr.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="fast,system", help="comma-separated: fast, system")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    tiers = args.tiers.split(",")
    if unknown := set(tiers) - set(TIERS):
        parser.error(f"unknown tier(s) {sorted(unknown)}; use fast and/or system")
    work = Path(tempfile.mkdtemp(prefix="ringtest-cover-"))
    codes = [run_tier(t, work, args.pytest_args) for t in tiers]
    lines = [f"{tier} tier: {percent(work, [tier])}% of src/ringtrain's lines" for tier in tiers]
    if len(tiers) > 1:
        lines.append(f"{' + '.join(tiers)}: {percent(work, tiers)}%")
    print("\n".join(lines) + f"\n(data in {work})")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
