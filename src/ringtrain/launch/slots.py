"""How many ranks this host holds without ``--oversubscribe``: its GPUs, else its cores.

``ringrun -np 99999`` on one host used to start processes for minutes. As mpirun does,
a host has slots, one rank per slot, and more ranks than slots need an explicit
``--oversubscribe``. A host listed with ``-H host:N`` or in a hostfile has the N slots
given (the user said so); only the implicit ``localhost`` of a job without ``-H`` is
counted here.

A GPU host has one slot per visible GPU (one rank per device is what NCCL needs: two
ranks on one device are refused, ``ncclInvalidUsage``); other hosts one per CPU this
process may use (:func:`ringtrain.cpus.cpu_count`: its affinity and a container's or
cgroup's CPU quota, not the machine's count). GPUs are counted without CUDA or torch: the NVIDIA driver lists one
directory per device under ``/proc/driver/nvidia/gpus``; ``CUDA_VISIBLE_DEVICES``
narrows them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ringtrain.cpus import cpu_count

__all__ = ["Slots", "count_slots", "local_slots"]

_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class Slots:
    count: int
    what: str  #: e.g. "2 CPU cores" or "8 GPUs", for messages


def _visible(devices: int, cuda_visible: str | None) -> int:
    if cuda_visible is None:
        return devices
    # CUDA stops at the first entry that is not a valid device ("-1", "NoDevFiles").
    seen = 0
    for entry in cuda_visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-") or entry == "NoDevFiles":
            break
        seen += 1
    return min(seen, devices)


def count_slots(cpus: int, gpus: int, cuda_visible: str | None = None) -> Slots:
    """This host's slots from its counts (pure)."""
    visible = _visible(gpus, cuda_visible)
    if visible > 0:
        return Slots(visible, f"{visible} GPU{'s' if visible != 1 else ''}")
    cpus = max(1, cpus)
    return Slots(cpus, f"{cpus} CPU core{'s' if cpus != 1 else ''}")


def _gpus() -> int:
    try:
        return sum(1 for _ in _NVIDIA_GPUS.iterdir())
    except OSError:
        return 0


def local_slots(environ: Mapping[str, str] | None = None) -> Slots:
    """The slots of this host (see the module docstring)."""
    env = os.environ if environ is None else environ
    return count_slots(cpu_count(), _gpus(), env.get("CUDA_VISIBLE_DEVICES"))
