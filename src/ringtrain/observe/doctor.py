"""``ringtrain doctor``: run a training script and say where its steps' time goes.

    ringtrain doctor [-np N] [--steps S] [--warmup W] [--out DIR] -- python train.py ARGS

The script runs unchanged (through ``ringrun -np N`` when N > 1). The doctor asks each
rank, through ``RINGTRAIN_DOCTOR*`` environment variables (see
:mod:`ringtrain.observe.session`), to meter its steps and, once S steps past W warm-up
steps are measured, to write its report to DIR and leave with exit code 0, so a long
training run is cut short after the measurement. The doctor then prints the verdict
(input-, exchange- or compute-bound) with the numbers behind it and advice, merges the
ranks' timelines into DIR/timeline.json and draws DIR/doctor.png.

Exit codes: 0 verdict printed; 2 bad usage; 3 no step was measured; otherwise the
script's own failing exit code (128 + N when killed by signal N), after its last
output lines.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ringtrain.argparsing import OneLineParser
from ringtrain.launch.cli import missing_script
from ringtrain.observe import plot
from ringtrain.observe.session import DOCTOR_ENV, DOCTOR_STEPS_ENV, DOCTOR_WARMUP_ENV
from ringtrain.observe.timeline import merge
from ringtrain.observe.verdict import diagnose, render
from ringtrain.processes import PlainProcess, stop_sequence

__all__ = ["main", "build_parser", "build_command", "load_reports", "EXIT_USAGE", "EXIT_NO_STEPS"]

EXIT_USAGE = 2
EXIT_NO_STEPS = 3
#: Output lines of the script kept to show when it fails.
TAIL_LINES = 20
NO_STEP_MESSAGE = ("no ringtrain step was measured: does the script use "
                   "rt.DistributedOptimizer / rt.data.Loader (or rt.observe.instrument)? "
                   "Metering starts at rt.init(): call it before the training loop")


class _UsageError(Exception):
    pass


class _Stopped(Exception):
    """The doctor got SIGTERM or SIGHUP (``kill``, ``timeout``, a closed terminal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        error=_UsageError,
        prog="ringtrain doctor",
        description="Run a training script, meter its steps on every rank and say what "
                    "limits it: input, gradient exchange or compute.",
        epilog="Example: ringtrain doctor -np 2 --steps 50 -- python train.py --epochs 1",
    )
    p.add_argument("-np", "--num-proc", dest="np", type=int, default=1,
                   help="processes (ranks); > 1 runs the script through ringrun (default 1)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than this host's cores (passed to ringrun)")
    p.add_argument("--steps", type=int, default=50,
                   help="steps to measure after the warm-up, then stop the script; "
                        "0 runs it to its end (default 50)")
    p.add_argument("--warmup", type=int, default=5,
                   help="first steps left out of the numbers (default 5)")
    p.add_argument("--out", default="runs/doctor",
                   help="directory for reports, timeline and plot (default runs/doctor)")
    p.add_argument("--timeline", help="trace path (default OUT/timeline.json)")
    p.add_argument("--no-plot", action="store_true", help="do not draw OUT/doctor.png")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="do not echo the script's output (it is still shown when it fails)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command to run, after --, e.g. -- python train.py")
    return p


def build_command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _UsageError("no command given; e.g. 'ringtrain doctor -- python train.py'")
    if args.np < 1:
        raise _UsageError(f"-np must be >= 1, got {args.np}")
    if args.steps < 0 or args.warmup < 0:
        raise _UsageError("--steps and --warmup must be >= 0")
    if args.oversubscribe and args.np == 1:
        raise _UsageError("--oversubscribe only applies with -np > 1 (more ranks than cores); "
                          "drop it, or give -np")
    exe = command[0]
    if shutil.which(exe) is None and not (os.sep in exe and os.access(exe, os.X_OK)):
        if os.path.isfile(exe):
            # ``ringtrain doctor -- train.py``: the file is there, the interpreter is missing.
            raise _UsageError(f"{exe!r} is a file, not a command; run it with python: "
                              f"ringtrain doctor -- python {' '.join(command)}")
        raise _UsageError(f"command {exe!r} not found; check the spelling or use a full path")
    if os.path.isdir(exe):
        raise _UsageError(f"command {exe!r} is a directory; give the program to run, e.g. -- python train.py")
    if args.np > 1:
        # ringrun as a module of this interpreter: no reliance on PATH.
        extra = ["--oversubscribe"] if args.oversubscribe else []
        return [sys.executable, "-m", "ringtrain.launch.cli", "-np", str(args.np), *extra, *command]
    return command


def _is_our_trace(path: Path) -> bool:
    """Whether ``path`` is a timeline ringtrain wrote (its ``otherData.producer``)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("otherData"), dict) \
        and doc["otherData"].get("producer") == "ringtrain"


def _check_paths(out: Path, timeline: Path) -> None:
    """Refuse paths the run would fail on or whose files it would wrongly replace."""
    if out.exists() and not out.is_dir():
        raise _UsageError(f"--out {str(out)!r} is a file; give a folder for the reports, e.g. runs/doctor")
    if timeline.is_dir():
        raise _UsageError(f"--timeline {str(timeline)!r} is a folder; give a file path, e.g. "
                          f"{timeline / 'timeline.json'}")
    # The old trace at this path is replaced, so that a run that writes none cannot show
    # the last one; a file that is not a ringtrain trace is the user's, never removed.
    for path in [timeline, *timeline.parent.glob(f"{timeline.stem}.rank*{timeline.suffix}")]:
        if path.is_file() and not _is_our_trace(path):
            raise _UsageError(f"--timeline: {str(path)!r} exists and is not a ringtrain timeline; "
                              "choose another path (it is not overwritten)")


def _new_folders(out: Path) -> list[Path]:
    """``out`` and those of its parents that do not exist yet, deepest first: what the
    doctor creates, and removes again when the job leaves nothing in them."""
    missing = []
    for folder in [out, *out.parents]:
        if folder.exists():
            break
        missing.append(folder)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders the doctor made (deepest first) while they are empty: a job
    that never started, or wrote nothing, leaves no empty ``runs/doctor`` behind."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:  # never made (mkdir failed below it)
            continue
        except OSError:  # not empty: the job's output, kept (and so are its parents)
            return


def _clean(out: Path, timeline: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _UsageError(f"--out {str(out)!r}: cannot create the folder ({exc.strerror}); "
                          "choose a folder you can write to") from None
    stale = [*out.glob("meter-*.json"), timeline,
             *timeline.parent.glob(f"{timeline.stem}.rank*{timeline.suffix}")]
    for path in stale:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _run(command: list[str], env: dict[str, str], quiet: bool) -> tuple[int, list[str]]:
    """Run, echoing output; returns (exit status, last output lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def on_signal(signum: int, _frame: object) -> None:
        raise _Stopped(signum)

    # SIGTERM/SIGHUP would end the doctor and leave the script (or ringrun and its ranks)
    # training on, orphaned: stop it first, as for Ctrl-C.
    previous = ({s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
                if threading.current_thread() is threading.main_thread() else {})
    proc: subprocess.Popen[str] | None = None
    try:
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if not quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
        code = proc.wait()
    except (KeyboardInterrupt, _Stopped):
        for s in previous:  # a second signal must not cut the stop short
            signal.signal(s, signal.SIG_IGN)
        if proc is not None:
            stop_sequence([PlainProcess(proc)], grace=10.0)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return (128 - code if code < 0 else code), list(tail)


def load_reports(out: Path) -> list[dict[str, Any]]:
    """The ranks' reports in ``out`` (unreadable files are skipped), by rank."""
    reports = []
    for path in sorted(out.glob("meter-*.json")):
        try:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(reports, key=lambda r: r.get("rank", 0))


def _say(message: str) -> None:
    print(f"ringtrain doctor: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    made: list[Path] = []
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        command = build_command(args)
        out = Path(args.out)
        timeline = Path(args.timeline) if args.timeline else out / "timeline.json"
        _check_paths(out, timeline)
        made = _new_folders(out)
        _clean(out, timeline)
        script = missing_script(args.command[1:] if args.command[:1] == ["--"] else args.command)
        if script is not None:
            raise _UsageError(f"script {script!r} does not exist (working directory {os.getcwd()}); "
                              "check the path")
    except _UsageError as exc:
        _remove_empty(made)
        print(f"ringtrain doctor: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _doctor(args, command, out, timeline)
    finally:
        _remove_empty(made)  # the job never started, or wrote nothing: no empty folders


def _doctor(args: argparse.Namespace, command: list[str], out: Path, timeline: Path) -> int:
    """Run the job and print the verdict; the exit code (see the module docstring)."""
    env = dict(os.environ)
    env.update({DOCTOR_ENV: str(out.resolve()), DOCTOR_STEPS_ENV: str(args.steps),
                DOCTOR_WARMUP_ENV: str(args.warmup), "RINGTRAIN_TIMELINE": str(timeline.resolve()),
                "PYTHONUNBUFFERED": "1"})
    shown = " ".join(args.command[1:] if args.command[:1] == ["--"] else args.command)
    until = f"{args.steps} steps after {args.warmup} warm-up" if args.steps else "to its end"
    _say(f"running '{shown}' on {args.np} rank(s), measuring {until}")
    try:
        code, tail = _run(command, env, args.quiet)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except _Stopped as exc:
        _say(f"stopped by {signal.Signals(exc.signum).name}; the script was stopped too")
        return 128 + exc.signum
    except OSError as exc:
        print(f"ringtrain doctor: error: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if code != 0:
        _say(f"the script failed with exit code {code}; its last lines:")
        for line in tail:
            print(f"  | {line}")
        return code
    reports = load_reports(out)
    measured = [r for r in reports if r.get("summary", {}).get("steps", 0) > 0]
    if not measured:
        seen = max((r.get("summary", {}).get("steps_seen", 0) for r in reports), default=0)
        if seen:
            _say(f"only {seen} step(s) ran, all inside the warm-up of {args.warmup}: let the "
                 "script run longer or lower --warmup")
        else:
            _say(NO_STEP_MESSAGE)
        return EXIT_NO_STEPS
    diagnosis = diagnose(measured)
    steps = min(r["summary"]["steps"] for r in measured)
    print()
    _say(f"{len(measured)} of {args.np} rank(s) reported, {steps} steps measured "
         f"after {args.warmup} warm-up"
         + (f" (the script ended before the {args.steps} asked)" if steps < args.steps else ""))
    if len(measured) < args.np:
        missing = sorted(set(range(args.np)) - {r["rank"] for r in measured})
        _say(f"no report from rank(s) {missing}")
    print(render(diagnosis))
    print()
    _say_files(out, timeline, measured, diagnosis.headline, args)
    return 0


def _say_files(out: Path, timeline: Path, reports: list[dict[str, Any]], title: str,
               args: argparse.Namespace) -> None:
    parts = sorted(timeline.parent.glob(f"{timeline.stem}.rank*{timeline.suffix}"))
    if parts:
        merge(parts, timeline)
    if timeline.exists():
        print(f"  timeline  {timeline}  (open in https://ui.perfetto.dev or chrome://tracing)")
    if not args.no_plot:
        if plot.available():
            png = plot.plot_reports(reports, out / "doctor.png", title=title.split(":")[0])
            print(f"  plot      {png}")
        else:
            print("  plot      skipped: matplotlib is not installed (pip install 'ringtrain[plot]')")
    print(f"  reports   {out}/meter-*.json")


if __name__ == "__main__":
    sys.exit(main())
