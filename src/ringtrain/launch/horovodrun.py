"""``horovodrun``: Horovod's launcher command line, run by ringrun.

    horovodrun -np 4 python train.py
    horovodrun -np 16 -H server1:4,server2:4,server3:4,server4:4 python train.py
    horovodrun --check-build

Horovod's flags are translated into ringrun's (:func:`translate`, pure) and the job is
run exactly as ringrun runs it; every rank gets ringtrain's environment and Horovod's
(``HOROVOD_RANK`` ... ``HOROVOD_HOSTNAME``, see :mod:`ringtrain.launch.horovod_env`).
Where Horovod's defaults differ from ringrun's, horovodrun keeps Horovod's: without
``-H`` the job runs on ``localhost:<np>`` (no core count check), and
``HOROVOD_START_TIMEOUT`` is read when ``--start-timeout`` is not given.

Three kinds of Horovod flags:
- translated: ``-np``, ``-H``, ``--hostfile``, ``-p``, ``-i``, ``--start-timeout``,
  ``--network-interface(s)`` (one interface), ``--output-filename``, ``--verbose``
  (prints the ringrun command line), ``--gloo`` (the only controller),
  ``--fusion-threshold-mb`` (ringtrain's ``fusion_mb``; 0, "no fusion", becomes one
  byte: every tensor travels alone) and ``--timeline-filename`` (``timeline``), each
  also as Horovod's own variable (``HOROVOD_FUSION_THRESHOLD`` in bytes,
  ``HOROVOD_TIMELINE``) as Horovod's launcher sets them,
  ``--stall-check-shutdown-time-seconds`` (``stall_timeout``: ringtrain's stall check
  ends the job, as Horovod's shutdown does); a fixed-size elastic job (``--min-np`` =
  ``--max-np`` = ``-np``) restarts from its last commit up to ``--reset-limit`` times
  (default 3) through ``--max-restarts``; a resizable one (``--min-np`` < ``--max-np``,
  or ``--host-discovery-script``) is ringrun's ``--min-np/--max-np`` job, resized in
  place (``--reset-limit``: ringrun's, the most changes of size);
- refused, one line and exit 2: what would run a different system (``--mpi``,
  ``--jsrun``, ``--mpi-args``, ``--binding-args``) and ``--config-file``;
- accepted with a warning that they have no effect here: Horovod's own tuning knobs
  (cycle time, cache, hierarchical collectives, autotune, logging, NCCL streams, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ringtrain.argparsing import OneLineParser
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.launch import cli
from ringtrain.launch.start import run_job
from ringtrain.settings import flag_specs

__all__ = ["Translation", "build_parser", "check_build_text", "main", "translate"]

#: Horovod's flags that would run another system; refused with the reason.
_REFUSED = {
    "use_mpi": ("--mpi", "ringtrain runs on torch.distributed (Gloo/NCCL) with a Gloo-style "
                "controller; drop --mpi (mpirun can start a ringtrain script itself)"),
    "use_jsrun": ("--jsrun", "jsrun launches MPI jobs; drop it and use -H or --hostfile"),
    "mpi_args": ("--mpi-args", "there is no mpirun underneath; pass variables with the "
                 "environment or use mpirun directly"),
    "binding_args": ("--binding-args", "process binding is an MPI option; drop it"),
    "config_file": ("--config-file", "give the settings as flags instead"),
}

#: Horovod's tuning flags without an equivalent here: (flags, nargs) -> accepted, warned.
_NO_EFFECT: list[tuple[tuple[str, ...], int]] = [
    (("--disable-cache",), 0), (("--cycle-time-ms",), 1), (("--cache-capacity",), 1),
    (("--hierarchical-allreduce",), 0), (("--no-hierarchical-allreduce",), 0),
    (("--hierarchical-allgather",), 0), (("--no-hierarchical-allgather",), 0),
    (("--autotune",), 0), (("--no-autotune",), 0), (("--autotune-log-file",), 1),
    (("--autotune-warmup-samples",), 1), (("--autotune-steps-per-sample",), 1),
    (("--autotune-bayes-opt-max-samples",), 1), (("--autotune-gaussian-process-noise",), 1),
    (("--timeline-mark-cycles",), 0), (("--no-timeline-mark-cycles",), 0),
    (("--no-stall-check",), 0), (("--stall-check",), 0),
    (("--stall-check-warning-time-seconds",), 1),
    (("--mpi-threads-disable",), 0), (("--no-mpi-threads-disable",), 0), (("--tcp",), 0),
    (("--num-nccl-streams",), 1), (("--thread-affinity",), 1), (("--gloo-timeout-seconds",), 1),
    (("--log-level",), 1), (("--log-with-timestamp",), 0), (("--log-without-timestamp",), 0),
    (("--log-hide-timestamp",), 0), (("--no-log-hide-timestamp",), 0),
    (("-prefix-timestamp", "--prefix-output-with-timestamp"), 0),
    (("--slots-per-host",), 1), (("--elastic-timeout",), 1), (("--blacklist-cooldown-range",), 2),
]

#: Restarts of a fixed-size elastic job without --reset-limit (Horovod's is unlimited;
#: a script that fails every time must not loop forever here).
DEFAULT_RESET_LIMIT = 3


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ringtrain")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="horovodrun", description="Horovod's launcher command line, run by "
                "ringtrain's ringrun on torch.distributed.",
                epilog="Example: horovodrun -np 2 python train.py")
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="number of processes")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="show which frameworks, controllers and tensor operations this engine has")
    p.add_argument("--start-timeout", type=float,
                   help="seconds for every host to start (default $HOROVOD_START_TIMEOUT or 30)")
    p.add_argument("--network-interface", "--network-interfaces", dest="nics", action="append",
                   default=[], help="the network interface to use (one)")
    p.add_argument("--output-filename", metavar="DIR", help="write each rank's output to DIR/rank.N.log")
    p.add_argument("--verbose", action="store_true", help="print the ringrun command line run")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port on all the hosts")
    p.add_argument("-i", "--ssh-identity-file", help="ssh private key")
    p.add_argument("--fusion-threshold-mb", type=float, help="fusion buffer size in MB (0: no fusion)")
    p.add_argument("--timeline-filename", help="write a Chrome trace timeline to this file")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float,
                   help="seconds a stalled exchange may wait before the job ends")
    elastic = p.add_argument_group("elastic (--min-np = --max-np: restarts; otherwise resized in place)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int)
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int)
    elastic.add_argument("--reset-limit", type=int, help="restarts of a fixed-size job (default "
                         f"{DEFAULT_RESET_LIMIT}); changes of size of a resizable one (default: no limit)")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="hosts and slots, e.g. host1:2,host2:4")
    hosts.add_argument("-hostfile", "--hostfile", help="file of 'host slots=N' or 'host:N' lines")
    hosts.add_argument("--host-discovery-script", help="executable printing 'host:slots' lines "
                       "(a resizable job)")
    controller = p.add_mutually_exclusive_group()
    controller.add_argument("--gloo", action="store_true", help="the Gloo controller (the only one)")
    controller.add_argument("--mpi", dest="use_mpi", action="store_true", help="(not supported)")
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true", help="(not supported)")
    p.add_argument("--mpi-args", help="(not supported)")
    p.add_argument("--binding-args", help="(not supported)")
    p.add_argument("--config-file", help="(not supported)")
    ignored = p.add_argument_group("Horovod tuning flags accepted without effect here")
    for names, nargs in _NO_EFFECT:
        dest = "ignored_" + names[-1].lstrip("-").replace("-", "_")
        if nargs == 0:
            ignored.add_argument(*names, dest=dest, action="store_true", help=argparse.SUPPRESS)
        else:
            ignored.add_argument(*names, dest=dest, nargs=nargs if nargs > 1 else None,
                                 help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return p


@dataclass(frozen=True)
class Translation:
    """What a horovodrun command line means for ringrun."""

    ringrun_argv: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    check_build: bool = False
    version: bool = False
    verbose: bool = False


def _setting_flag(name: str) -> str:
    """ringrun's flag for the settings field ``name`` (derived from Settings, as in cli)."""
    return next(spec.flag for spec in flag_specs() if spec.field == name)


def _resizable(args: argparse.Namespace) -> bool:
    """Whether the job changes size in place (ringrun's --min-np/--max-np)."""
    if args.host_discovery_script:
        return True
    if args.min_np is None and args.max_np is None:
        return False
    return len({n for n in (args.np, args.min_np, args.max_np) if n is not None}) > 1 \
        or args.min_np is None or args.max_np is None


def _elastic(args: argparse.Namespace) -> int | None:
    """The fixed size of an 'elastic' job (min = max = -np), or None otherwise."""
    if args.min_np is None or args.max_np is None or _resizable(args):
        return None
    return int(args.min_np)


def _resize_flags(args: argparse.Namespace) -> list[str]:
    """ringrun's flags for a resizable job (Horovod's --min-np defaults to -np)."""
    min_np = args.min_np if args.min_np is not None else args.np
    if min_np is None:
        raise ConfigError("--min-np is needed for an elastic job (or -np, which it defaults to)")
    out = ["--min-np", str(min_np)]
    if args.max_np is not None:
        out += ["--max-np", str(args.max_np)]
    if args.reset_limit is not None:
        out += ["--reset-limit", str(args.reset_limit)]
    return out


def translate(argv: list[str], environ: Mapping[str, str] | None = None) -> Translation:
    """Horovod's command line -> ringrun's (pure apart from reading ``environ``)."""
    env = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    if args.version or args.check_build:
        return Translation(check_build=args.check_build, version=args.version, verbose=args.verbose)
    for dest, (flag, why) in _REFUSED.items():
        if getattr(args, dest):
            raise ConfigError(f"{flag} is not supported: {why}")
    fixed = _elastic(args)
    resizable = _resizable(args)
    np = args.np if args.np is not None else fixed
    if np is None and not resizable:
        raise ConfigError("-np is required, e.g. 'horovodrun -np 2 python train.py'")
    out = ["-np", str(np)] if np is not None else []
    if resizable:
        out += _resize_flags(args)
    if args.host_discovery_script:
        out += ["--host-discovery-script", args.host_discovery_script]
    elif args.hosts:
        out += ["-H", args.hosts]
    elif args.hostfile:
        out += ["--hostfile", args.hostfile]
    else:
        # Horovod's default: localhost:<np> (a resizable job: room for --max-np)
        out += ["-H", f"localhost:{max(1, args.max_np or np or 1)}"]
    if args.ssh_port is not None:
        out += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        out += ["-i", args.ssh_identity_file]
    timeout = args.start_timeout
    if timeout is None and env.get("HOROVOD_START_TIMEOUT", "").strip():
        try:
            timeout = float(env["HOROVOD_START_TIMEOUT"])
        except ValueError:
            raise ConfigError(f"HOROVOD_START_TIMEOUT={env['HOROVOD_START_TIMEOUT']!r} is not a "
                              "number of seconds") from None
    if timeout is not None:
        out += ["--start-timeout", f"{timeout:g}"]
    nics = sorted({n.strip() for item in args.nics for n in item.split(",") if n.strip()})
    if len(nics) > 1:
        raise ConfigError(f"--network-interface {','.join(nics)}: give one interface; ringrun uses "
                          "one for the rendezvous and for Gloo/NCCL")
    if nics:
        out += ["--network-interface", nics[0]]
    if args.output_filename:
        out += ["--output-filename", args.output_filename]
    if args.fusion_threshold_mb is not None:
        if args.fusion_threshold_mb < 0:
            raise ConfigError(f"--fusion-threshold-mb must be >= 0, got {args.fusion_threshold_mb:g}")
        # 0 is Horovod's "no fusion": a one-byte bucket, so every tensor travels alone.
        mb = args.fusion_threshold_mb or 1 / 2**20
        out += [_setting_flag("fusion_mb"), repr(mb),
                # and Horovod's own variable, in bytes, as its horovodrun sets it
                "-x", f"HOROVOD_FUSION_THRESHOLD={int(args.fusion_threshold_mb * 2**20)}"]
    if args.timeline_filename:
        out += [_setting_flag("timeline"), args.timeline_filename,
                "-x", f"HOROVOD_TIMELINE={args.timeline_filename}"]
    if args.stall_check_shutdown_time_seconds:  # Horovod's 0: never shut down
        out += [_setting_flag("stall_timeout"), f"{args.stall_check_shutdown_time_seconds:g}"]
    if fixed is not None:
        limit = DEFAULT_RESET_LIMIT if args.reset_limit is None else args.reset_limit
        out += ["--max-restarts", str(limit)]
    elif args.reset_limit is not None and not resizable:
        out += ["--max-restarts", str(args.reset_limit)]
    warnings = [f"{names[-1]} has no effect with ringtrain (ignored)" for names, _ in _NO_EFFECT
                if getattr(args, "ignored_" + names[-1].lstrip("-").replace("-", "_")) not in (None, False)]
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return Translation(out + ["--", *command] if command else out, warnings, verbose=args.verbose)


def check_build_text(facts: Mapping[str, object]) -> str:
    """Horovod's ``--check-build`` table for this engine, from ``probe_build``'s facts (pure)."""
    def box(on: object) -> str:
        return "[X]" if on else "[ ]"

    torch_ok = bool(facts.get("torch"))
    nccl = torch_ok and bool(facts.get("nccl")) and bool(facts.get("cuda"))
    gloo = torch_ok and bool(facts.get("gloo"))
    lines = [
        f"ringtrain {facts.get('ringtrain', '?')} (horovodrun command line; "
        f"torch {facts.get('torch') or 'not installed'}):",
        "",
        "Available Frameworks:",
        f"    {box(False)} TensorFlow",
        f"    {box(torch_ok)} PyTorch",
        f"    {box(False)} MXNet",
        "",
        "Available Controllers:",
        f"    {box(False)} MPI",
        f"    {box(gloo)} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {box(nccl)} NCCL",
        f"    {box(False)} DDL",
        f"    {box(False)} CCL",
        f"    {box(False)} MPI",
        f"    {box(gloo)} Gloo",
    ]
    return "\n".join(lines) + "\n"


_PROBE = ("import json, torch, torch.distributed as d; print(json.dumps({'torch': torch.__version__, "
          "'cuda': torch.cuda.is_available(), 'nccl': d.is_nccl_available(), "
          "'gloo': d.is_gloo_available()}))")


def probe_build(python: str = sys.executable, timeout: float = 120.0) -> dict[str, object]:
    """What the workers' interpreter provides, asked in a child process: the launcher
    itself imports no torch."""
    facts: dict[str, object] = {"ringtrain": _version()}
    try:
        res = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
        if res.returncode == 0:
            facts.update(json.loads(res.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        pass
    return facts


def main(argv: list[str] | None = None) -> int:
    try:
        plan = translate(list(sys.argv[1:] if argv is None else argv))
        if plan.version:
            print(f"ringtrain {_version()} (horovodrun)")
            return 0
        if plan.check_build:
            print(check_build_text(probe_build()), end="")
            return 0
        for warning in plan.warnings:
            print(f"horovodrun: warning: {warning}", file=sys.stderr)
        if plan.verbose:
            print("horovodrun: running ringrun " + shlex.join(plan.ringrun_argv), file=sys.stderr)
        cfg = cli.build_config(plan.ringrun_argv)
        for warning in cfg.warnings:
            print(f"horovodrun: warning: {warning}", file=sys.stderr)
        return run_job(cfg)
    except ConfigError as exc:
        print(f"horovodrun: error: {exc}", file=sys.stderr)
        return 2
    except RingtrainError as exc:
        print(f"horovodrun: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
