"""``horovodrun``: Horovod's launcher command line, run by ringrun.

    horovodrun -np 4 python train.py
    horovodrun -np 16 -H server1:4,server2:4,server3:4,server4:4 python train.py
    horovodrun -np 2 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py
    horovodrun --config-file horovod.yaml -np 4 python train.py
    horovodrun --check-build

Every flag of Horovod 0.28.1's horovodrun is accepted; the parser is built from the table
in :mod:`ringtrain.launch.horovod_flags` (which also gives docs/migrate.md its table):
*mapped* flags become ringrun's (:func:`translate`, pure), *no-effect* ones (Horovod's own
engine knobs) print one line saying why, and ``--mpi`` / ``--jsrun`` are refused with the
alternative. ``--config-file`` (Horovod's YAML) and the ``HOROVOD_*`` variables of the same
settings fill in what the command line does not give (:mod:`.horovod_config`; the command
line wins, then the file, then the environment).

Every rank gets ringtrain's environment and Horovod's (``HOROVOD_RANK`` ...
``HOROVOD_HOSTNAME``, see :mod:`ringtrain.launch.horovod_env`). Where Horovod's defaults
differ from ringrun's, horovodrun keeps Horovod's: without ``-H`` the job runs on
``localhost:<np>``; a resizable job (``--min-np`` < ``--max-np``, ``--min-np`` without
``--max-np``, or a discovery script) runs with Horovod's elastic rules (ringrun
``--like-horovod``: every host name is a host, the first world takes every slot up to
``--max-np``, a failed rank's host is blacklisted with its ranks, ``--elastic-timeout``
600 s) and Horovod's messages. One exception, kept from ringrun: a fixed-size "elastic"
job (``--min-np`` = ``--max-np`` = ``-np``) restarts from its last commit up to
``--reset-limit`` times (default 3), where Horovod would wait for a replacement host.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ringtrain.argparsing import OneLineParser
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.launch import cli
from ringtrain.launch.horovod_config import config_values, env_values, read_config
from ringtrain.launch.horovod_flags import FLAGS, Flag, by_dest
from ringtrain.launch.hosts import TooFewSlots
from ringtrain.launch.start import run_job
from ringtrain.settings import flag_specs

__all__ = ["DEFAULT_ELASTIC_TIMEOUT", "DEFAULT_RESET_LIMIT", "HOROVOD_STOP_GRACE_S", "STOP_FLAGS", "Translation", "build_parser",
           "check_build_text", "main", "translate"]

#: Restarts of a fixed-size elastic job without --reset-limit (Horovod's is unlimited;
#: a script that fails every time must not loop forever here).
DEFAULT_RESET_LIMIT = 3
#: Seconds Horovod's launcher gives a rank between SIGTERM and SIGKILL (its
#: GRACEFUL_TERMINATION_TIME_S).
HOROVOD_STOP_GRACE_S = 5.0
#: How every horovodrun job stops its ranks. Horovod's launcher stops them (on Ctrl-C or
#: SIGTERM to it, or when one rank failed) with SIGTERM and SIGKILLs them 5 s later
#: (safe_shell_exec's graceful termination): a Horovod script saves in a SIGTERM handler
#: and never sees a KeyboardInterrupt. ringrun's own default passes on the signal it
#: got (SIGINT on Ctrl-C) with 2.5 s, as torchrun does.
STOP_FLAGS = ("--stop-signal", "TERM", "--stop-grace", f"{HOROVOD_STOP_GRACE_S:g}")
#: Horovod's --elastic-timeout default (seconds).
DEFAULT_ELASTIC_TIMEOUT = 600.0
#: --no-stall-check: ringtrain's stall_timeout must be finite; a year is "never".
_NO_STALL_TIMEOUT_S = 365 * 24 * 3600
#: Horovod's log levels -> ringtrain's (the logging module's names).
_LOG_LEVELS = {"TRACE": "debug", "DEBUG": "debug", "INFO": "info", "WARNING": "warning",
               "ERROR": "error", "FATAL": "critical"}
_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "choice": str.upper, "int int": float}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ringtrain")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def _add(p: argparse.ArgumentParser, flag: Flag) -> None:
    help_text = ("(no effect here) " if flag.kind == "no-effect" else
                 "(not supported) " if flag.kind == "refused" else "") + flag.meaning.replace("%", "%%")
    if flag.value == "flag":
        p.add_argument(*flag.names, dest=flag.dest, action="store_const", const=True, default=None,
                       help=help_text)
        if flag.inverse:
            p.add_argument(*flag.inverse, dest=flag.dest, action="store_const", const=False, default=None,
                           help=argparse.SUPPRESS)
        return
    kind = _TYPES[flag.value]
    p.add_argument(*flag.names, dest=flag.dest, type=kind, default=None, help=help_text,
                   nargs=2 if flag.value == "int int" else None,
                   choices=flag.choices or None,
                   metavar=("MIN", "MAX") if flag.value == "int int" else None)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="horovodrun", description="Horovod's launcher command line, run by "
                "ringtrain's ringrun on torch.distributed (docs/migrate.md has every flag).",
                epilog="Example: horovodrun -np 2 python train.py")
    seen: set[str] = set()
    for flag in FLAGS:
        if flag.names[0] in seen:
            continue
        seen.update(flag.names)
        _add(p, flag)
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


def _resizable(a: dict[str, Any]) -> bool:
    """Whether the job changes size in place (ringrun's --min-np/--max-np)."""
    if a["host_discovery_script"]:
        return True
    sizes = (a["num_proc"], a["min_num_proc"], a["max_num_proc"])
    if a["min_num_proc"] is None and a["max_num_proc"] is None:
        return False
    return len({n for n in sizes if n is not None}) > 1 or a["min_num_proc"] is None \
        or a["max_num_proc"] is None


def _fixed_elastic(a: dict[str, Any]) -> int | None:
    """The fixed size of an 'elastic' job (min = max = -np), or None otherwise."""
    if a["min_num_proc"] is None or a["max_num_proc"] is None or _resizable(a):
        return None
    return int(a["min_num_proc"])


def _gather(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str],
                                                                          list[str]]:
    """Every destination's value (command line, then --config-file, then HOROVOD_*), where
    each came from, and the config file's warnings."""
    values = {f.dest: getattr(args, f.dest) for f in FLAGS}
    names = {f.dest: f.names[-1] for f in FLAGS}
    source = {d: names[d] for d, v in values.items() if v is not None}
    warnings: list[str] = []
    layers = []
    if values["config_file"]:
        found, warnings = config_values(read_config(values["config_file"]), values["config_file"])
        layers.append(found)
    layers.append(env_values(environ))
    for layer in layers:
        for dest, (value, where) in layer.items():
            if values.get(dest) is None:
                values[dest], source[dest] = value, where
    return values, source, warnings


def _hosts_flags(a: dict[str, Any], np: int | None) -> list[str]:
    for flag, dest in (("-H", "hosts"), ("--hostfile", "hostfile"),
                       ("--host-discovery-script", "host_discovery_script")):
        if a[dest] is not None and not a[dest].strip():  # '' would silently mean localhost
            raise ConfigError(f"{flag} is empty; give it a value (e.g. -H server1:4,server2:4) "
                              "or leave it out to run on localhost")
    given = [n for n, d in (("-H", "hosts"), ("--hostfile", "hostfile"),
                            ("--host-discovery-script", "host_discovery_script")) if a[d]]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} cannot be used together; give one of them")
    if a["host_discovery_script"]:
        return ["--host-discovery-script", a["host_discovery_script"]]
    if a["hosts"]:
        return ["-H", a["hosts"]]
    if a["hostfile"]:
        return ["--hostfile", a["hostfile"]]
    # Horovod's default: localhost:<np> (a resizable job: room for --max-np)
    return ["-H", f"localhost:{max(1, a['max_num_proc'] or 0, np or 0, a['min_num_proc'] or 0)}"]


def _resize_flags(a: dict[str, Any], source: Mapping[str, str]) -> list[str]:
    """ringrun's flags for a resizable job, with Horovod's rules (--min-np defaults to -np)."""
    min_np = a["min_num_proc"] if a["min_num_proc"] is not None else a["num_proc"]
    if min_np is None:
        raise ConfigError("--min-np is needed for an elastic job (or -np, which it defaults to)")
    out = ["--like-horovod", "--min-np", str(min_np)]
    if a["max_num_proc"] is not None:
        out += ["--max-np", str(a["max_num_proc"])]
    if a["reset_limit"] is not None:
        out += ["--reset-limit", str(a["reset_limit"])]
    timeout = DEFAULT_ELASTIC_TIMEOUT if a["elastic_timeout"] is None else a["elastic_timeout"]
    if not 0 <= timeout < math.inf:  # named here: it may be HOROVOD_ELASTIC_TIMEOUT
        raise ConfigError(f"{source['elastic_timeout']} must be >= 0 seconds, got {timeout:g}")
    out += ["--elastic-timeout", f"{timeout:g}"]
    if a["cooldown_range"] is not None:
        out += ["--blacklist-cooldown-range", *(f"{x:g}" for x in a["cooldown_range"])]
    if a["slots"] is not None:
        out += ["--slots-per-host", str(a["slots"])]
    return out


def _tuning_flags(a: dict[str, Any], source: Mapping[str, str]) -> list[str]:
    """ringrun's flags for Horovod's settings that ringtrain has; ``source`` names where
    each value came from (a flag, a config file key or a HOROVOD_* variable)."""
    out: list[str] = []
    if a["fusion_threshold_mb"] is not None:
        if not 0 <= a["fusion_threshold_mb"] < math.inf:  # NaN too
            shown = (f"{a['fusion_threshold_mb'] * 2**20:.0f} bytes"
                     if source["fusion_threshold_mb"] == "HOROVOD_FUSION_THRESHOLD"
                     else f"{a['fusion_threshold_mb']:g}")
            raise ConfigError(f"{source['fusion_threshold_mb']} must be >= 0, got {shown}")
        # 0 is Horovod's "no fusion": a one-byte bucket, so every tensor travels alone.
        mb = a["fusion_threshold_mb"] or 1 / 2**20
        out += [_setting_flag("fusion_mb"), repr(mb),
                # and Horovod's own variable, in bytes, as its horovodrun sets it
                "-x", f"HOROVOD_FUSION_THRESHOLD={int(a['fusion_threshold_mb'] * 2**20)}"]
    if a["timeline_filename"]:
        out += [_setting_flag("timeline"), a["timeline_filename"],
                "-x", f"HOROVOD_TIMELINE={a['timeline_filename']}"]
    if a["timeline_mark_cycles"]:
        out += ["-x", "HOROVOD_TIMELINE_MARK_CYCLES=1"]
    if a["no_stall_check"]:
        out += [_setting_flag("stall_timeout"), str(_NO_STALL_TIMEOUT_S), "-x", "HOROVOD_STALL_CHECK_DISABLE=1"]
    else:
        if a["stall_check_shutdown_time_seconds"] is not None and a["stall_check_shutdown_time_seconds"] < 0:
            raise ConfigError(f"{source['stall_check_shutdown_time_seconds']} must be >= 0 seconds "
                              f"(0: never shut down), got {a['stall_check_shutdown_time_seconds']}")
        shutdown, every = a["stall_check_shutdown_time_seconds"], a["stall_check_warning_time_seconds"]
        every = 60 if every is None else every
        if shutdown and every and shutdown < every:
            # Horovod's stall inspector drops a shutdown time below its check interval (it
            # looks for stalls once per interval); so do the ranks (horovod/stall.py).
            print(f"horovodrun: warning: --stall-check-shutdown-time-seconds {shutdown} is less than the "
                  f"stall check time ({every} s): as in Horovod, a stalled operation is never shut down; "
                  "give it at least the check time", file=sys.stderr)
        elif shutdown:  # Horovod's 0: never shut down (the hvd default)
            out += [_setting_flag("stall_timeout"), f"{shutdown:g}"]
        if a["stall_check_warning_time_seconds"] is not None:
            if a["stall_check_warning_time_seconds"] < 0:
                raise ConfigError(f"{source['stall_check_warning_time_seconds']} must be >= 0, got "
                                  f"{a['stall_check_warning_time_seconds']}")
            out += ["-x", f"HOROVOD_STALL_CHECK_TIME_SECONDS={a['stall_check_warning_time_seconds']}"]
    if a["gloo_timeout_seconds"] is not None:
        if a["gloo_timeout_seconds"] <= 0:
            raise ConfigError(f"{source['gloo_timeout_seconds']} must be > 0, got {a['gloo_timeout_seconds']}")
        out += [_setting_flag("init_timeout"), str(a["gloo_timeout_seconds"])]
    if a["log_level"] is not None:
        out += [_setting_flag("log_level"), _LOG_LEVELS[a["log_level"]]]
    if a["log_with_timestamp"]:
        out += [_setting_flag("log_time")]
    if a["prefix_output_with_timestamp"]:
        out += ["--timestamp-output"]
    if a["tcp_flag"]:
        out += ["-x", "NCCL_IB_DISABLE=1"]  # what Horovod's --tcp sets
    return out


def translate(argv: list[str], environ: Mapping[str, str] | None = None) -> Translation:
    """Horovod's command line -> ringrun's (pure apart from reading ``environ`` and
    ``--config-file``)."""
    env = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    if args.version or args.check_build:
        return Translation(check_build=bool(args.check_build), version=bool(args.version),
                           verbose=bool(args.verbose))
    a, source, warnings = _gather(args, env)
    for flag in FLAGS:
        if flag.kind == "refused" and a[flag.dest]:
            raise ConfigError(f"{source[flag.dest]} is not supported: {flag.meaning}")
    fixed = _fixed_elastic(a)
    resizable = _resizable(a)
    np = a["num_proc"] if a["num_proc"] is not None else fixed
    if np is None and not resizable:
        raise ConfigError("-np is required, e.g. 'horovodrun -np 2 python train.py'")
    out = [*STOP_FLAGS, "-np", str(np)] if np is not None else [*STOP_FLAGS]
    if resizable:
        out += _resize_flags(a, source)
    else:
        for dest in ("elastic_timeout", "cooldown_range", "slots") + (("reset_limit",) if fixed is None else ()):
            if a[dest] is not None:
                warnings.append(f"{source[dest]} applies to an elastic job (--min-np/--max-np or "
                                "--host-discovery-script); ignored")
    out += _hosts_flags(a, np)
    if a["ssh_port"] is not None:
        out += ["-p", str(a["ssh_port"])]
    if a["ssh_identity_file"]:
        out += ["-i", a["ssh_identity_file"]]
    if a["start_timeout"] is not None:
        if not 0 < a["start_timeout"] < math.inf:  # NaN too; named here: it may be HOROVOD_START_TIMEOUT
            raise ConfigError(f"{source['start_timeout']} must be > 0 seconds, got {a['start_timeout']:g}")
        out += ["--start-timeout", f"{a['start_timeout']:g}"]
    nics = [n.strip() for n in (a["nics"] or "").split(",") if n.strip()]
    if nics:
        # ringrun uses one interface for the rendezvous and Gloo/NCCL (Horovod's Gloo
        # controller also takes only one)
        out += ["--network-interface", nics[0]]
        if len(nics) > 1:
            warnings.append(f"{source['nics']} {','.join(nics)}: ringtrain uses the first, {nics[0]}")
    if a["output_filename"]:
        # Horovod writes the files (DIR/rank.N/stdout, stderr) and shows the output on
        # the terminal as well.
        out += ["--output-filename", a["output_filename"], "--output-tee", "--output-layout", "horovod"]
    out += _tuning_flags(a, source)
    if fixed is not None:
        limit = DEFAULT_RESET_LIMIT if a["reset_limit"] is None else a["reset_limit"]
        out += ["--max-restarts", str(limit)]
    rows = by_dest()
    warnings += [f"{source[dest]} has no effect with ringtrain: {rows[dest].meaning}"
                 for dest in sorted(rows, key=lambda d: [f.dest for f in FLAGS].index(d))
                 if rows[dest].kind == "no-effect" and a[dest] is not None]
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return Translation(out + ["--", *command] if command else out, warnings, verbose=bool(a["verbose"]))


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
    cli.drop_torchrun_agent_variables()
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
        for warning in cli.launch_warnings(cfg):
            print(f"horovodrun: warning: {warning}", file=sys.stderr)
        return run_job(cfg)
    except TooFewSlots as exc:
        # ringrun's advice names its --oversubscribe, which horovodrun (as Horovod's, whose
        # launcher refuses more ranks than slots too) does not accept.
        print(f"horovodrun: error: -np {exc.np} is more than the {exc.total} slots of {exc.listed}; "
              "lower -np, or give the hosts more slots (-H host:N, or 'host slots=N' lines "
              "in --hostfile)", file=sys.stderr)
        return 2
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
