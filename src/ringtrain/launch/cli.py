"""``ringrun``: start a data-parallel job, horovodrun-style.

    ringrun -np 4 python train.py
    ringrun -np 16 -H server1:4,server2:4,server3:4,server4:4 python train.py
    ringrun -np 8 --hostfile hosts.txt --max-restarts 3 python train.py
    ringrun --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh python train.py

Parsing and checking are pure (``build_config``: a config and its warnings); ``main``
is the only place that prints them and turns errors into a message and an exit code.
The settings flags (``--stall-timeout``, ``--no-progress``, ...) are derived from
:class:`ringtrain.settings.Settings`, one per field.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ringtrain import addresses
from ringtrain.argparsing import OneLineParser
from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.launch import slurm
from ringtrain.launch.elastic.worlds import ElasticConfig
from ringtrain.launch.hosts import Host, is_local_host, parse_hostfile, parse_hosts, place_ranks
from ringtrain.launch.job import STOP_GRACE_S, JobConfig
from ringtrain.launch.members import substitute_local_rank
from ringtrain.launch.output import LAYOUTS, check_output_dir
from ringtrain.launch.slots import local_slots
from ringtrain.launch.ssh import SshOptions, parse_ssh_option
from ringtrain.launch.start import run_job
from ringtrain.processes import RESULT_MARKER_ENV
from ringtrain.settings import env_name, flag_specs, settings_env, unknown_variables

__all__ = ["STOP_SIGNALS", "TORCHRUN_AGENT_VARIABLES", "build_config", "build_parser",
           "drop_torchrun_agent_variables", "main", "missing_script"]


# torchrun's flags that ringrun does not take, and what to write instead: a torchrun
# command line moved to ringrun gets the fix in its one error line.
#: ``--stop-signal``'s names (``TERM``, ``SIGTERM`` and ``term`` alike).
STOP_SIGNALS = {"INT": int(signal.SIGINT), "TERM": int(signal.SIGTERM), "HUP": int(signal.SIGHUP)}
_RDZV = "ringrun is the job's rendezvous: drop the flag (--master-addr/--master-port set its address)"
_LOGS = ("--output-filename DIR writes each rank's output to DIR/rank.N.log (--output-layout horovod: "
         "DIR/rank.N/stdout and stderr; --output-tee: and to the terminal)")
TORCHRUN_HINTS = {
    "--nproc-per-node": "ringrun takes the job's total, -np N (with -H host1:K,host2:K for K per host)",
    "--nnodes": "ringrun lists the hosts with -H host1:K,host2:K (or --hostfile); "
                "--min-np/--max-np make a resizable job",
    "--node-rank": "ringrun starts every host's ranks itself, over ssh: run it once, on one host",
    "--standalone": "ringrun on one host needs no rendezvous flag: drop it",
    "--rdzv-backend": _RDZV, "--rdzv-endpoint": _RDZV, "--rdzv-id": _RDZV, "--rdzv-conf": _RDZV,
    "--master-addr": "ringrun spells it --master-addr ADDR",
    "--master-port": "ringrun spells it --master-port PORT",
    "--max-restarts": "ringrun spells it --max-restarts K",
    "--log-dir": _LOGS,
    "--redirects": _LOGS,
    "--tee": _LOGS,
    "--no-python": "ringrun runs the command as given: ringrun -np N ./program",
    "-m": "ringrun runs the command as given: ringrun -np N python -m MODULE",
    "--module": "ringrun runs the command as given: ringrun -np N python -m MODULE",
    "--run-path": "ringrun runs the command as given: ringrun -np N python SCRIPT",
    "-r": _LOGS, "-t": _LOGS,
    "--local-ranks-filter": "ringrun shows every rank's output, [rank]-prefixed; --output-filename "
                            "DIR keeps each rank's apart, in DIR/rank.N.log",
    "--duplicate-stdout-filters": _LOGS, "--duplicate-stderr-filters": _LOGS, "--logs-specs": _LOGS,
    "--role": "ringrun's ranks are one role (ROLE_NAME=default): drop the flag",
    "--shutdown-timeout": "ringrun spells it --stop-grace S",
    "--signals-to-handle": "ringrun passes on the SIGINT, SIGTERM or SIGHUP it gets (--stop-signal SIG: one of them)",
    "--local-addr": "ringrun finds each host's address (--network-interface IF picks its interface)",
    "--monitor-interval": "ringrun notes a rank's exit as it happens: drop the flag",
    "--start-method": "ringrun starts each rank as a process of its own: drop the flag",
    "--event-log-handler": "ringrun prints its events on stderr: drop the flag",
    "--numa-binding": "ringrun does not bind ranks to NUMA nodes: wrap the command in numactl",
    "--virtual-local-rank": "ringrun gives each rank its own LOCAL_RANK: drop the flag",
}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        hints=TORCHRUN_HINTS,
        prog="ringrun",
        description="Start N copies of a training script with the ringtrain environment.",
        epilog="Example: ringrun -np 2 python examples/mnist_cnn.py",
    )
    p.add_argument("-np", "--num-proc", dest="np", type=int,
                   help="number of processes (ranks) to start (in a Slurm allocation: "
                        "default SLURM_NTASKS)")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="hosts and slots, e.g. server1:4,server2:4 (default "
                                             "localhost, or the nodes of the Slurm allocation)")
    hosts.add_argument("--hostfile", help="file with lines 'host slots=N'")
    hosts.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="resizable job: an executable that prints the hosts available now, "
                            "one 'host:slots' line each (run about every second)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than slots (this host's GPUs, else its CPU cores, "
                        "or the slots given with -H / --hostfile)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole job up to K times when a worker dies (default 0)")
    elastic = p.add_argument_group("resizable jobs (Horovod's elastic mode; see docs/launch.md)")
    elastic.add_argument("--min-np", type=int, metavar="M",
                         help="go on with at least M ranks when workers or hosts are lost")
    elastic.add_argument("--max-np", type=int, metavar="N",
                         help="grow onto new hosts up to N ranks (default: the slots of -H, or "
                              "no limit with --host-discovery-script)")
    elastic.add_argument("--reset-limit", type=int, metavar="K",
                         help="end a resizable job after K changes of size (default: no limit)")
    elastic.add_argument("--elastic-timeout", type=float, default=0.0, metavar="S",
                         help="when fewer than --min-np ranks are left, wait up to S seconds for "
                              "hosts before ending the job (default 0: end at once)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                         help="a failed host comes back after MIN..MAX seconds, doubled at each "
                              "failure (default: a discovered host after 60 s, a -H host never)")
    elastic.add_argument("--slots-per-host", type=int, metavar="N",
                         help="slots of a host the discovery script prints without ':slots' (default 1)")
    elastic.add_argument("--like-horovod", action="store_true",
                         help="Horovod's elastic rules, as horovodrun uses them: every host name is "
                              "a host (localhost and 127.0.0.1 are two), the first world takes "
                              "every slot up to --max-np, a failed rank's host leaves with all its "
                              "ranks (docs/launch.md)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="write each rank's output to DIR/rank.N.log (stdout and stderr) instead "
                        "of the terminal")
    p.add_argument("--output-layout", choices=LAYOUTS, default=None,
                   help="with --output-filename: 'log' (default) DIR/rank.N.log; 'horovod' "
                        "DIR/rank.N/stdout and DIR/rank.N/stderr, N zero-padded (horovodrun's)")
    p.add_argument("--output-tee", action="store_true",
                   help="with --output-filename: show the ranks' output on the terminal too")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank]")
    p.add_argument("--timestamp-output", action="store_true",
                   help="start each line of the ranks' output with the time it was written")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    p.add_argument("-i", "--ssh-identity-file", help="ssh private key for the remote hosts")
    p.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra ssh -o option, e.g. UserKnownHostsFile=/path (repeatable)")
    p.add_argument("-x", dest="export", action="append", default=[], metavar="VAR[=VALUE]",
                   help="pass an environment variable to every worker (repeatable)")
    p.add_argument("--network-interface", help="interface (e.g. eth1) for the rendezvous and Gloo/NCCL traffic")
    p.add_argument("--master-addr", help="address of rank 0's host that all hosts can reach")
    p.add_argument("--master-port", type=int, help="rendezvous port (default: a free one)")
    p.add_argument("--start-timeout", type=float, default=30.0,
                   help="seconds to wait for every remote host's agent to answer (default 30)")
    p.add_argument("--stop-grace", type=float, default=STOP_GRACE_S, metavar="S",
                   help="seconds the ranks have to end after ringrun passed them its SIGINT/SIGTERM/"
                        f"SIGHUP (or stopped them) before SIGKILL (default {STOP_GRACE_S:g}; "
                        "torchrun's --shutdown-timeout waits 30); a second Ctrl-C kills at once")
    p.add_argument("--stop-signal", choices=sorted(STOP_SIGNALS), metavar="SIG",
                   type=lambda name: name.upper().removeprefix("SIG"),
                   help="the signal the ranks get when ringrun is stopped: INT, TERM or HUP "
                        "(default: the one ringrun received, SIGINT on Ctrl-C, as torchrun; "
                        "horovodrun passes TERM, as Horovod's launcher)")
    settings = p.add_argument_group("settings (each sets its RINGTRAIN_* variable for every worker)")
    for spec in flag_specs():
        if spec.kind is bool:
            settings.add_argument(spec.flag, dest=f"setting_{spec.field}", action="store_const",
                                  const=spec.flag.startswith("--" + spec.field.replace("_", "-")),
                                  default=None, help=spec.help)
        else:
            settings.add_argument(spec.flag, dest=f"setting_{spec.field}", type=spec.kind,
                                  choices=spec.choices, default=None, help=spec.help,
                                  metavar=None if spec.choices else spec.field.split("_")[-1].upper())
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, e.g. python train.py")
    return p


def _check_command(command: list[str]) -> None:
    if not command:
        raise ConfigError("no command given; e.g. 'ringrun -np 2 python train.py'")
    exe = command[0]
    if exe.endswith(".py") and os.path.isfile(exe) and not os.access(exe, os.X_OK):
        # torchrun's spelling (it runs the script with its own interpreter).
        raise ConfigError(f"{exe!r} is a Python script: write 'ringrun ... python {exe}' "
                          "(torchrun adds python itself; ringrun runs the command it is given)")
    if os.sep in exe:
        if os.path.isdir(exe):
            raise ConfigError(f"command {exe!r} is a directory; give the program to run, "
                              "e.g. 'python train.py'")
        if not os.access(exe, os.X_OK):
            raise ConfigError(f"command {exe!r} does not exist or is not executable; check the path")
    elif shutil.which(exe) is None:
        raise ConfigError(f"command {exe!r} not found on PATH; check the spelling or use a full path")
    script = missing_script(command)
    if script is not None:
        raise ConfigError(f"script {script!r} does not exist (working directory {os.getcwd()})")


def missing_script(command: list[str]) -> str | None:
    """The script of ``python SCRIPT.py ...`` when no such file exists (else None): the
    job would start only for every rank to fail at once (``ringtrain doctor`` checks
    the same)."""
    if Path(command[0]).name.startswith("python") and len(command) > 1:
        script = command[1]
        if script.endswith(".py") and not script.startswith("-") and not Path(script).is_file():
            return script
    return None


def _settings_env(args: argparse.Namespace, exported: dict[str, str]) -> dict[str, str]:
    """The flags' RINGTRAIN_* variables, checked with the -x exports beside them: local
    ranks take -x last and remote ones take the flag last, so the two naming one setting
    would give ranks different values."""
    given = {spec.field: getattr(args, f"setting_{spec.field}") for spec in flag_specs()}
    env = settings_env(given)
    for spec in flag_specs():
        name = env_name(spec.field)
        if name in env and name in exported:
            raise ConfigError(f"-x {name}={exported[name]} and {spec.flag} both set {name}; give one of them")
    # The -x values of ringtrain's own settings reach every rank: check them here too.
    settings_env({}, {**os.environ, **{k: v for k, v in exported.items() if k.startswith("RINGTRAIN_")}})
    return env


def _ssh_options(args: argparse.Namespace) -> SshOptions:
    identity = args.ssh_identity_file
    if identity is not None and not os.access(identity, os.R_OK):
        raise ConfigError(f"--ssh-identity-file {identity} cannot be read; check the path")
    return SshOptions(
        port=args.ssh_port,
        identity_file=identity,
        options=tuple(parse_ssh_option(o) for o in args.ssh_option),
        connect_timeout=args.start_timeout,
    )


def _check_interface(name: str | None, any_local: bool, multi_host: bool,
                     warnings: list[str]) -> str | None:
    if name is None:
        return None
    if "," in name or not name.strip():
        raise ConfigError(f"--network-interface {name!r}: give one interface name, e.g. eth1 "
                          "(ringrun uses one for the rendezvous and Gloo/NCCL)")
    if not multi_host:
        warnings.append(f"--network-interface {name} has no effect on a one-host job "
                        "(it stays on loopback)")
        return None
    if any_local and addresses.address_of_interface(name) is None:
        have = ", ".join(addresses.interface_addresses()) or "none"
        raise ConfigError(f"--network-interface {name} has no IPv4 address on this host "
                          f"(interfaces with one: {have}); pick one of those")
    return name


def _exports(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name.isidentifier():
            raise ConfigError(f"-x {item!r}: {name!r} is not a variable name; use -x NAME or -x NAME=VALUE")
        if not sep:
            if name not in os.environ:
                raise ConfigError(f"-x {name}: {name} is not set here; set it or use -x {name}=VALUE")
            value = os.environ[name]
        env[name] = value
    return env


@dataclass(frozen=True)
class _Where:
    """The hosts a job runs on, how they are reached, and the number of ranks."""

    hosts: list[Host]
    np: int
    note: str = ""  #: where the slots came from, for the "more than the slots" message
    transport: str = "ssh"
    slurm_cpus: dict[str, int] = field(default_factory=dict)


def _where(args: argparse.Namespace, warnings: list[str]) -> _Where:
    """-H, --hostfile, the Slurm allocation ringrun runs in, or this host, in that order."""
    np = args.np
    if args.host_discovery_script:  # resizable: the script says where, at run time
        return _Where([], np or 0)
    if args.hosts or args.hostfile:
        hosts = parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile)
        resizable = args.min_np is not None or args.max_np is not None
        return _Where(hosts, np or 0 if resizable else _required_np(np))
    alloc = slurm.allocation(os.environ)
    if alloc is not None:  # inside sbatch/salloc: the allocation's nodes, each by a job step
        hosts = list(alloc.hosts)
        if args.ssh_port is not None or args.ssh_identity_file or args.ssh_option:
            warnings.append("ssh options have no effect inside a Slurm allocation (the nodes are "
                            "reached with srun); pass -H to use ssh instead")
        note = (f"Slurm job {alloc.job_id} ({','.join(f'{h.name}:{h.slots}' for h in hosts)}: "
                "its tasks per node; request more with --ntasks-per-node, or run here with -H "
                "localhost:N)")
        np = np if np is not None else (alloc.ntasks or sum(h.slots for h in hosts))
        return _Where(hosts, np, note, "srun", alloc.cpus)
    here = local_slots()
    return _Where([Host("localhost", here.count)], _required_np(np), f"this host ({here.what})")


def _required_np(np: int | None) -> int:
    if np is None:
        raise ConfigError("-np N is required (the number of ranks to start); "
                          "e.g. 'ringrun -np 2 python train.py'")
    return int(np)


_SLOTS_PER_HOST_ONLY = ("--slots-per-host applies to the hosts a --host-discovery-script prints; "
                        "give -H hosts their slots as host:N")

#: ``--max-np`` of a resizable job with a discovery script and no --max-np: no limit.
UNLIMITED_NP = 1_000_000


def _elastic(args: argparse.Namespace, where: _Where, warnings: list[str]) -> ElasticConfig | None:
    """The resizable job's settings, or None for a fixed-size job."""
    if args.min_np is None and args.max_np is None and not args.host_discovery_script:
        for given, flag in [(args.reset_limit is not None, "--reset-limit"),
                            (args.elastic_timeout, "--elastic-timeout"),
                            (args.blacklist_cooldown_range, "--blacklist-cooldown-range"),
                            (args.like_horovod, "--like-horovod")]:
            if given:
                raise ConfigError(f"{flag} applies to a resizable job; add --min-np and --max-np")
        if args.slots_per_host is not None:
            raise ConfigError(_SLOTS_PER_HOST_ONLY)
        return None
    if where.transport == "srun":
        raise ConfigError("a resizable job (--min-np/--max-np) cannot run inside a Slurm "
                          "allocation (its nodes are fixed); pass -H or --host-discovery-script")
    if args.max_restarts:
        raise ConfigError("--max-restarts restarts a fixed-size job; a resizable one goes on "
                          "with the ranks left (use --reset-limit to bound its changes)")
    if args.master_addr or args.master_port is not None:
        raise ConfigError("--master-addr/--master-port cannot be used with --min-np/--max-np: "
                          "rank 0, and with it the rendezvous, may move to another host")
    script = args.host_discovery_script
    if script and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise ConfigError(f"--host-discovery-script {script} is not an executable file; "
                          "chmod +x it or check the path")
    if args.oversubscribe:
        warnings.append("--oversubscribe has no effect on a resizable job (one rank per slot)")
    if args.slots_per_host is not None and not script and not args.like_horovod:
        raise ConfigError(_SLOTS_PER_HOST_ONLY)
    min_np = args.min_np if args.min_np is not None else args.np
    if min_np is None:
        raise ConfigError("--min-np M is needed for a resizable job (the fewest ranks it may go on with)")
    slots = sum(h.slots for h in where.hosts)
    max_np = args.max_np if args.max_np is not None else (UNLIMITED_NP if script else slots)
    if not script and max_np > slots and args.like_horovod:
        # Horovod's --max-np is a cap: with fixed hosts its job runs on the slots there are.
        max_np = slots
    if not script and max_np > slots:
        raise ConfigError(f"--max-np {max_np} is more than the {slots} slots of the hosts listed; "
                          "lower it, or add hosts (or use --host-discovery-script)")
    cooldown = args.blacklist_cooldown_range
    return ElasticConfig(min_np=min_np, max_np=max_np, hosts=tuple(where.hosts),
                         discovery_script=script, np=args.np, reset_limit=args.reset_limit,
                         cooldown_range=tuple(cooldown) if cooldown else None,
                         elastic_timeout=args.elastic_timeout, like_horovod=args.like_horovod,
                         slots_per_host=1 if args.slots_per_host is None else args.slots_per_host)


def build_config(argv: list[str], local_rank_macro: bool = False) -> JobConfig:
    """The job ``argv`` (ringrun's flags and the command) describes, checked.
    ``local_rank_macro``: replace torchrun's ``${local_rank}`` in the command's arguments
    (ringrun's :func:`main`; horovodrun's command runs untouched, as Horovod's)."""
    args = build_parser().parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    # (a script named with the macro, 'train_${local_rank}.py', is looked for as rank 0's)
    _check_command(list(substitute_local_rank(command, 0)) if local_rank_macro else command)
    for flag, value in (("-H", args.hosts), ("--hostfile", args.hostfile),
                        ("--host-discovery-script", args.host_discovery_script)):
        if value is not None and not value.strip():  # '' would silently mean "this host"
            raise ConfigError(f"{flag} is empty; give it a value (e.g. -H server1:4,server2:4) "
                              "or leave it out to run on this host")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not 0 < args.start_timeout < math.inf:  # NaN too
        raise ConfigError(f"--start-timeout must be > 0 seconds, got {args.start_timeout:g}")
    if not 0 <= args.stop_grace < math.inf:  # NaN too
        raise ConfigError(f"--stop-grace must be a number of seconds >= 0, got {args.stop_grace:g}; "
                          f"e.g. --stop-grace 30 (the default is {STOP_GRACE_S:g})")
    if args.output_filename:
        check_output_dir(args.output_filename)
    elif args.output_tee:
        raise ConfigError("--output-tee shows the output that --output-filename DIR writes to "
                          "files on the terminal too; add --output-filename DIR, or drop --output-tee")
    elif args.output_layout:
        raise ConfigError("--output-layout names the files --output-filename DIR writes; add "
                          "--output-filename DIR, or drop --output-layout")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ConfigError(f"--master-port {args.master_port} is not a TCP port; use 1..65535")
    warnings: list[str] = []
    if args.host_discovery_script or args.min_np is not None or args.max_np is not None:
        if not (args.hosts or args.hostfile or args.host_discovery_script):
            raise ConfigError("a resizable job (--min-np/--max-np) needs its hosts: -H, "
                              "--hostfile or --host-discovery-script")
    exported = _exports(args.export)
    where = _where(args, warnings)
    hosts, transport = where.hosts, where.transport
    elastic = _elastic(args, where, warnings)
    placements = [] if elastic is not None else place_ranks(
        hosts, where.np, oversubscribe=args.oversubscribe, slots_note=where.note)

    def local(host: str) -> bool:
        return transport == "ssh" and is_local_host(host)

    named = [p.host for p in placements] if elastic is None else [h.name for h in hosts]
    # A discovery script's hosts are not known yet: assume they may be remote.
    multi_host = any(not local(h) for h in named) or bool(args.host_discovery_script)
    any_local = any(local(h) for h in named)
    interface = _check_interface(args.network_interface, any_local, multi_host, warnings)
    # (with Horovod's rules two names of this machine are two hosts, both started here)
    if sum(local(h.name) for h in hosts) > 1 and not (elastic is not None and elastic.like_horovod):
        raise ConfigError("this host is listed more than once (e.g. localhost and 127.0.0.1); "
                          "list it once with its total slots")
    return JobConfig(
        command=tuple(command),
        placements=tuple(placements),
        max_restarts=args.max_restarts,
        output_dir=args.output_filename,
        prefix_output=not args.no_prefix,
        timestamp_output=args.timestamp_output,
        tee_output=args.output_tee,
        output_layout=args.output_layout or "log",
        extra_env=exported,
        master_addr=args.master_addr,
        master_port=args.master_port,
        settings_env=_settings_env(args, exported),
        ssh=_ssh_options(args),
        network_interface=interface,
        start_timeout=args.start_timeout,
        stop_grace=args.stop_grace,
        stop_signal=STOP_SIGNALS[args.stop_signal] if args.stop_signal else None,
        warnings=tuple(warnings),
        transport=transport,
        slurm_cpus=where.slurm_cpus,
        elastic=elastic,
        result_marker=os.environ.get(RESULT_MARKER_ENV) or None,
        local_rank_macro=local_rank_macro,
    )


def launch_warnings(cfg: JobConfig) -> list[str]:
    """``cfg``'s warnings and one per ``RINGTRAIN_*`` variable the ranks would get that
    ringtrain does not read (a misspelt setting keeps its default silently otherwise)."""
    return [*cfg.warnings, *unknown_variables({**os.environ, **cfg.extra_env})]


#: torchrun's agent's own variables: a torchrun worker that started ringrun hands them
#: on, and in ringrun's ranks they would point torch at an agent that is not there
#: (TORCHELASTIC_USE_AGENT_STORE makes init_process_group() wait, as a client, for a
#: store nobody serves).
TORCHRUN_AGENT_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
                            "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE")


def drop_torchrun_agent_variables() -> None:
    """Remove :data:`TORCHRUN_AGENT_VARIABLES` from this launcher's environment (which
    every local rank, and every resizable job's worker, starts from)."""
    for name in TORCHRUN_AGENT_VARIABLES:
        os.environ.pop(name, None)


def main(argv: list[str] | None = None) -> int:
    drop_torchrun_agent_variables()
    try:
        cfg = build_config(list(sys.argv[1:] if argv is None else argv), local_rank_macro=True)
        for warning in launch_warnings(cfg):
            print(f"ringrun: warning: {warning}", file=sys.stderr)
        return run_job(cfg)
    except ConfigError as exc:
        print(f"ringrun: error: {exc}", file=sys.stderr)
        return 2
    except RingtrainError as exc:
        print(f"ringrun: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
