"""The ssh command line and what it forwards (pure)."""

from __future__ import annotations

import shlex

import pytest

from ringtrain.errors import ConfigError
from ringtrain.launch.ssh import SshOptions, agent_command, forwarded_env, parse_ssh_option, ssh_argv


def _options(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]


def test_ssh_argv_is_batch_mode_with_port_identity_and_keepalive() -> None:
    argv = ssh_argv("server2", SshOptions(port=2222, identity_file="/k/id", connect_timeout=7.5), "CMD")
    assert argv[:2] == ["ssh", "-T"]
    assert argv[-2:] == ["server2", "CMD"]
    assert argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-i") + 1] == "/k/id"
    opts = _options(argv)
    assert "BatchMode=yes" in opts and "ConnectTimeout=8" in opts
    assert "StrictHostKeyChecking=accept-new" in opts and "ServerAliveInterval=5" in opts
    assert "IdentitiesOnly=yes" in opts


def test_user_ssh_options_come_first_so_they_win() -> None:
    # OpenSSH keeps the first value it reads for an option.
    argv = ssh_argv("h", SshOptions(options=("StrictHostKeyChecking=yes",)), "CMD")
    opts = _options(argv)
    assert opts.index("StrictHostKeyChecking=yes") < opts.index("StrictHostKeyChecking=accept-new")


def test_no_port_or_identity_flags_unless_given() -> None:
    argv = ssh_argv("h", SshOptions(), "CMD")
    assert "-p" not in argv and "-i" not in argv


@pytest.mark.parametrize("bad", [{"port": 0}, {"port": 70000}, {"connect_timeout": 0}])
def test_bad_ssh_options_are_config_errors(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        SshOptions(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["foo", "=x", "Key=", "Bad Key=1"])
def test_ssh_option_must_be_key_value(text: str) -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_ssh_option(text)


def test_agent_command_quotes_paths_and_execs() -> None:
    cmd = agent_command("/opt/my env/bin/python", "/src/ringtrain/launch/agent.py")
    assert shlex.split(cmd) == ["exec", "/opt/my env/bin/python", "/src/ringtrain/launch/agent.py"]


def test_forwarded_env_is_a_short_list_plus_exports() -> None:
    environ = {"PATH": "/venv/bin:/usr/bin", "HOME": "/root", "SECRET": "x", "NCCL_DEBUG": "INFO",
               "RINGTRAIN_BACKEND": "gloo", "SSH_AUTH_SOCK": "/tmp/a"}
    env = forwarded_env(environ, {"WANDB_MODE": "offline"})
    assert env == {"PATH": "/venv/bin:/usr/bin", "NCCL_DEBUG": "INFO", "RINGTRAIN_BACKEND": "gloo",
                   "WANDB_MODE": "offline"}
