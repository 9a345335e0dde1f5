"""What a process sets up for itself when it joins: the backend, its device, the
interface Gloo binds, and the ``[ringtrain rank N]`` log prefix (pure decisions, apart
from pinning the device and adding the log handler once)."""

from __future__ import annotations

import logging
import os

import torch

from ringtrain import addresses
from ringtrain.env import LaunchEnv
from ringtrain.errors import ConfigError
from ringtrain.settings import Settings

__all__ = ["NCCL_TIMEOUT_MARGIN_S", "choose_backend", "configure_logging", "existing_backend", "gloo_interface",
           "nccl_op_timeout", "own_gpus", "pin_device"]

log = logging.getLogger("ringtrain")


#: Launchers that can give each process GPUs of its own through ``CUDA_VISIBLE_DEVICES``
#: (``srun --gpus-per-task``, ``--gpu-bind``; an mpirun or torchrun wrapper that sets it
#: from the local rank). ringrun starts every rank of a host with the same environment.
_BINDING_LAUNCHERS = ("slurm", "mpirun", "torchrun")


def own_gpus(env: LaunchEnv) -> bool:
    """Whether this process was given GPUs of its own: it sees some, fewer than the
    host's processes, under a launcher that binds them and with ``CUDA_VISIBLE_DEVICES``
    set. It then uses its first, ``cuda:0``; local rank r on ``cuda:r`` left every rank
    but the first on the CPU, and with Gloo, under ``srun --gpus-per-task=1``."""
    if env.launcher not in _BINDING_LAUNCHERS or not os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return False
    return torch.cuda.is_available() and 1 <= torch.cuda.device_count() < env.local_size


def choose_backend(requested: str, env: LaunchEnv) -> str:
    local_size = env.local_size
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise ConfigError(
                "backend 'nccl' needs CUDA GPUs but none is available; use backend='gloo' or 'auto'"
            )
        if requested == "nccl" and torch.cuda.device_count() < local_size and not own_gpus(env):
            # pin_device() gives local rank r the GPU cuda:r; a rank without one was left
            # on the CPU under NCCL, and its first collective failed (NCCL moves only CUDA
            # tensors), or two ranks shared a GPU (ncclInvalidUsage).
            raise ConfigError(
                f"backend 'nccl' needs one GPU per process on this host ({local_size} processes), "
                f"but this process sees {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); local rank r uses cuda:r, "
                "so show every process all of the host's GPUs, or use backend='gloo' or 'auto'"
            )
        return requested
    # NCCL only when every process on this host can own a GPU: sharing one GPU
    # between NCCL ranks is unsupported (ncclInvalidUsage).
    if torch.cuda.is_available() and (torch.cuda.device_count() >= local_size or own_gpus(env)):
        return "nccl"
    return "gloo"


#: How much longer than the stall timeout an NCCL group's watchdog lets an operation run.
#: Its clock starts when the operation is queued (a gradient bucket: during the backward
#: pass), the stall check's when the caller waits; the check then reads the store.
NCCL_TIMEOUT_MARGIN_S = 60.0


def nccl_op_timeout(settings: Settings) -> float:
    """Seconds an operation may run on an NCCL group ringtrain makes (its ``timeout=``).

    NCCL's watchdog acts on its own timeout: it aborts the communicators and, under
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (ringrun's default, as torchrun's), ends the
    process from its thread. It must come after ringtrain's stall check, which names the
    missing ranks (a StallError); with the init timeout alone (300 s), a stall timeout
    raised past it (a long evaluation on one rank) was cut short by a SIGABRT instead.
    """
    return max(settings.init_timeout, settings.stall_timeout + NCCL_TIMEOUT_MARGIN_S)


def existing_backend(name: str, config: str, device: torch.device) -> str:
    """The backend of a group the script made itself, for ``device``'s tensors.

    ``init_process_group()`` without a backend makes one backend per device type
    (``get_backend()`` is ``"undefined"``, the config ``"cpu:gloo,cuda:nccl"`` on a GPU
    host): a CUDA process's exchanges then run on NCCL, where treating the group as
    not-NCCL staged every CUDA tensor through host memory and Gloo."""
    if ":" not in config:
        return name
    per_device = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return per_device.get(device.type, per_device.get("cpu", name))


def gloo_interface(env: LaunchEnv) -> str | None:
    """The interface Gloo should bind when the launcher did not say (None: leave it).

    Gloo binds the address the host name resolves to, which may be 127.0.1.1 or an
    interface the other hosts cannot reach (seen under srun). A one-host job stays on
    loopback, so nothing listens on the network; across hosts, the interface that routes
    to rank 0. (Gloo reads only the variable ``GLOO_SOCKET_IFNAME``.)
    """
    if env.gloo_interface is not None:
        return None
    if addresses.is_loopback(env.master_addr):
        return "lo"
    return addresses.interface_towards(env.master_addr)


def pin_device(env: LaunchEnv) -> torch.device:
    """``cuda:<local_rank>`` made current (``cuda:0`` for a process with GPUs of its own,
    :func:`own_gpus`), else the CPU."""
    index = 0 if own_gpus(env) else env.local_rank
    if torch.cuda.is_available() and torch.cuda.device_count() > index:
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def configure_logging(env: LaunchEnv, settings: Settings) -> None:
    # One handler for the "ringtrain" logger with the rank in every line, added once;
    # its level and time stamps from the settings (Horovod's --log-level and
    # --log-with-timestamp). A level the script set on the logger itself is kept.
    time_part = "%(asctime)s " if settings.log_time else ""
    fmt = logging.Formatter(f"{time_part}[ringtrain rank {env.rank}] %(levelname)s %(message)s")
    ours = [h for h in log.handlers if getattr(h, "_ringtrain", False)]
    if ours:
        ours[0].setFormatter(fmt)
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(fmt)
        handler._ringtrain = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    if log.level == logging.NOTSET or getattr(log, "_ringtrain_level", False):
        log.setLevel(settings.log_level.upper())
        log._ringtrain_level = True  # type: ignore[attr-defined]
    log.propagate = False
