"""The NCCL error handling ringrun gives its workers: a fixed-size job's survivors end
(torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING=1), a resizable job's survive a lost peer
(2: the communicators are aborted, the process stays up to join the next world), and a
value the user set on ringrun's host wins on every host."""

from __future__ import annotations

from ringtrain.launch.agent import worker_extras
from ringtrain.launch.ssh import forwarded_env

VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def test_a_fixed_size_worker_is_torn_down_as_under_torchrun() -> None:
    assert worker_extras({}, 1, 1)[VAR] == "1"


def test_a_resizable_worker_only_aborts_its_communicators() -> None:
    # Under 1, ProcessGroupNCCL's watchdog rethrows a peer's failure on its own thread,
    # which ends the process: no survivor would reach the next world.
    assert worker_extras({"RINGTRAIN_ELASTIC_FILE": "/tmp/w0.json"}, 1, 1)[VAR] == "2"


def test_the_users_choice_wins() -> None:
    assert VAR not in worker_extras({VAR: "0", "RINGTRAIN_ELASTIC_FILE": "/tmp/w0.json"}, 1, 1)
    assert VAR not in worker_extras({VAR: "3"}, 1, 1)


def test_torchs_nccl_settings_reach_remote_hosts() -> None:
    # The agent fills in its default when the rank's environment lacks the variable:
    # without forwarding, a value set on ringrun's host held for its local ranks only.
    environ = {VAR: "0", "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900",
               "TORCH_HOME": "/x"}
    env = forwarded_env(environ, {})
    assert env == {VAR: "0", "TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"}
    assert VAR not in worker_extras(env, 1, 1)
