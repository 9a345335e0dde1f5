"""``ringrun``: start a data-parallel job, horovodrun-style.

    ringrun -np 4 python train.py
    ringrun -np 16 -H server1:4,server2:4,server3:4,server4:4 python train.py
    ringrun -np 8 --hostfile hosts.txt --max-restarts 3 python train.py

Parsing and checking are pure (``build_config``: a config and its warnings); ``main``
is the only place that prints them and turns errors into a message and an exit code.
The settings flags (``--stall-timeout``, ``--no-progress``, ...) are derived from
:class:`ringtrain.settings.Settings`, one per field.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ringtrain.errors import ConfigError, RingtrainError
from ringtrain.launch import network, slurm
from ringtrain.launch.hosts import Host, is_local_host, parse_hostfile, parse_hosts, place_ranks
from ringtrain.launch.job import JobConfig, run_job
from ringtrain.launch.output import check_output_dir
from ringtrain.launch.slots import local_slots
from ringtrain.launch.ssh import SshOptions, parse_ssh_option
from ringtrain.settings import flag_specs, settings_env

__all__ = ["build_config", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line instead of argparse's usage block; main prints it.
        raise ConfigError(f"{message} (see 'ringrun --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
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
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than slots (this host's GPUs, else its CPU cores, "
                        "or the slots given with -H / --hostfile)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the whole job up to K times when a worker dies (default 0)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="write each rank's output to DIR/rank.N.log instead of the terminal")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank]")
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
    if os.sep in exe:
        if not os.access(exe, os.X_OK):
            raise ConfigError(f"command {exe!r} does not exist or is not executable; check the path")
    elif shutil.which(exe) is None:
        raise ConfigError(f"command {exe!r} not found on PATH; check the spelling or use a full path")
    if Path(exe).name.startswith("python") and len(command) > 1:
        script = command[1]
        if script.endswith(".py") and not script.startswith("-") and not Path(script).is_file():
            raise ConfigError(f"script {script!r} does not exist (working directory {os.getcwd()})")


def _settings_env(args: argparse.Namespace) -> dict[str, str]:
    given = {spec.field: getattr(args, f"setting_{spec.field}") for spec in flag_specs()}
    return settings_env(given)


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
    if not multi_host:
        warnings.append(f"--network-interface {name} has no effect on a one-host job "
                        "(it stays on loopback)")
        return None
    if any_local and network.address_of_interface(name) is None:
        have = ", ".join(network.interface_addresses()) or "none"
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
    if args.hosts or args.hostfile:
        hosts = parse_hosts(args.hosts) if args.hosts else parse_hostfile(args.hostfile)
        return _Where(hosts, _required_np(np))
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


def build_config(argv: list[str]) -> JobConfig:
    args = build_parser().parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    _check_command(command)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.start_timeout <= 0:
        raise ConfigError(f"--start-timeout must be > 0 seconds, got {args.start_timeout:g}")
    if args.output_filename:
        check_output_dir(args.output_filename)
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ConfigError(f"--master-port {args.master_port} is not a TCP port; use 1..65535")
    warnings: list[str] = []
    where = _where(args, warnings)
    hosts, transport = where.hosts, where.transport
    placements = place_ranks(hosts, where.np, oversubscribe=args.oversubscribe,
                             slots_note=where.note)

    def local(host: str) -> bool:
        return transport == "ssh" and is_local_host(host)

    multi_host = any(not local(p.host) for p in placements)
    any_local = any(local(p.host) for p in placements)
    interface = _check_interface(args.network_interface, any_local, multi_host, warnings)
    if sum(local(h.name) for h in hosts) > 1:
        raise ConfigError("this host is listed more than once (e.g. localhost and 127.0.0.1); "
                          "list it once with its total slots")
    return JobConfig(
        command=tuple(command),
        placements=tuple(placements),
        max_restarts=args.max_restarts,
        output_dir=args.output_filename,
        prefix_output=not args.no_prefix,
        extra_env=_exports(args.export),
        master_addr=args.master_addr,
        master_port=args.master_port,
        settings_env=_settings_env(args),
        ssh=_ssh_options(args),
        network_interface=interface,
        start_timeout=args.start_timeout,
        warnings=tuple(warnings),
        transport=transport,
        slurm_cpus=where.slurm_cpus,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = build_config(list(sys.argv[1:] if argv is None else argv))
        for warning in cfg.warnings:
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
