"""How ringrun reaches another host: the OpenSSH command line and what it forwards (pure).

One ssh connection per host and attempt runs the host agent (:mod:`ringtrain.launch.agent`),
which starts that host's ranks. Options, and why:

- ``BatchMode=yes``: never prompt for a password (a prompt would hang a job start).
- ``StrictHostKeyChecking=accept-new``: trust a host on first contact, refuse one whose
  key changed. Pin keys instead with ``--ssh-option UserKnownHostsFile=FILE`` and
  ``--ssh-option StrictHostKeyChecking=yes``.
- ``ConnectTimeout`` = ``--start-timeout``; ``ServerAliveInterval=5``,
  ``ServerAliveCountMax=3``: a host that vanishes without closing its connections
  (power loss, cable) is noticed within about 15 s and the job restarts.
- ``-T``: no terminal, so the agent sees end-of-input when the connection ends.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ringtrain.errors import ConfigError

__all__ = [
    "AGENT_SCRIPT",
    "FORWARDED_NAMES",
    "FORWARDED_PREFIXES",
    "SshOptions",
    "agent_command",
    "forwarded_env",
    "parse_ssh_option",
    "ssh_argv",
]

#: Variables forwarded to remote workers by default, so ``python`` means the same
#: interpreter there; anything else needs ``-x NAME``.
FORWARDED_NAMES = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH")
#: ``TORCH_NCCL_``: torch's NCCL settings (async error handling, blocking wait, the
#: heartbeat monitor) must be the same on every rank; a value in ringrun's environment
#: wins over the agent's default (see ``agent.worker_extras``) on remote hosts too.
FORWARDED_PREFIXES = ("RINGTRAIN_", "NCCL_", "GLOO_", "TORCH_NCCL_")

#: The host agent, run by absolute path on every host (ssh) or node (srun).
AGENT_SCRIPT = Path(__file__).resolve().with_name("agent.py")


@dataclass(frozen=True)
class SshOptions:
    port: int | None = None
    identity_file: str | None = None
    #: Extra ``-o KEY=VALUE`` options from ``--ssh-option``, placed before ringrun's own.
    options: tuple[str, ...] = field(default_factory=tuple)
    connect_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.port is not None and not 0 < self.port < 65536:
            raise ConfigError(f"--ssh-port {self.port} is not a TCP port; use 1..65535")
        if self.connect_timeout <= 0:
            raise ConfigError(f"--start-timeout must be > 0, got {self.connect_timeout}")


def parse_ssh_option(text: str) -> str:
    """Check one ``--ssh-option KEY=VALUE``."""
    key, sep, value = text.partition("=")
    if not sep or not key.isalnum() or not value:
        raise ConfigError(
            f"--ssh-option {text!r} is not KEY=VALUE; e.g. --ssh-option UserKnownHostsFile=/path"
        )
    return text


def ssh_argv(host: str, opts: SshOptions, remote_command: str) -> list[str]:
    """The full ``ssh`` command line that runs ``remote_command`` on ``host``."""
    argv = ["ssh", "-T"]
    # OpenSSH keeps the first value given for an option, so the user's come first.
    for option in opts.options:
        argv += ["-o", option]
    argv += [
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=accept-new",
        "-o", f"ConnectTimeout={max(1, math.ceil(opts.connect_timeout))}",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-o", "LogLevel=ERROR",
    ]
    if opts.port is not None:
        argv += ["-p", str(opts.port)]
    if opts.identity_file:
        argv += ["-i", opts.identity_file, "-o", "IdentitiesOnly=yes"]
    argv += [host, remote_command]
    return argv


def agent_command(python: str, agent: str | Path = AGENT_SCRIPT) -> str:
    """The shell command the remote login shell runs: the agent, by absolute path.

    ringtrain must live at the same path on every host (a shared file system or the
    same image), as the training script and its interpreter must.
    """
    return f"exec {shlex.quote(python)} {shlex.quote(str(agent))}"


def forwarded_env(environ: Mapping[str, str], exports: Mapping[str, str],
                  names: Sequence[str] = FORWARDED_NAMES) -> dict[str, str]:
    """What a remote worker inherits from ringrun's environment: a short list plus ``-x``."""
    env = {k: v for k, v in environ.items()
           if k in names or k.startswith(FORWARDED_PREFIXES)}
    env.update(exports)
    return env
