"""ringrun inside a Slurm allocation: the allocation's nodes, and ``srun`` to reach them (pure).

In a batch script (``sbatch``) or an ``salloc`` shell, ``ringrun python train.py``
needs no ``-H``: the nodes are ``SLURM_JOB_NODELIST`` with ``SLURM_TASKS_PER_NODE``
slots each, and ``-np`` defaults to ``SLURM_NTASKS``. Each node's host agent is started
as a one-task job step, ``srun --nodes=1 --ntasks=1 --nodelist=NODE ... agent.py``,
instead of over ssh:

- it works wherever the allocation works (many clusters refuse ssh to compute nodes, or
  allow it only through pam_slurm_adopt);
- the ranks run inside the job's steps, so Slurm accounts for them, confines them to
  the job's CPUs and devices, and ends them with the job (``scancel``, time limit);
- srun carries the agent protocol on its stdin/stdout as ssh does, so the rest of
  ringrun is the same. A node that dies ends its srun ("Node failure", once slurmctld
  declares the node down after ``SlurmdTimeout``), which ringrun sees as a lost host.

``--overlap`` lets a restart's new agent step start while the previous attempt's step
is still being cleaned up, and ``--cpu-bind=none`` leaves CPU placement to the agent
(it sets ``OMP_NUM_THREADS`` from the CPUs it may use). Inside a job step
(``SLURM_STEP_ID`` set) with several tasks ringrun would run once per task: that is
refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ringtrain.env import expand_slurm_nodelist
from ringtrain.errors import ConfigError, LaunchEnvError
from ringtrain.launch.hosts import Host

__all__ = ["Allocation", "allocation", "expand_counts", "srun_argv"]

_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


@dataclass(frozen=True)
class Allocation:
    """The Slurm job ringrun runs in."""

    job_id: str
    hosts: tuple[Host, ...]
    ntasks: int | None
    cpus: dict[str, int]  #: CPUs of the job on each node, for the agent's step


def expand_counts(text: str) -> list[int]:
    """Expand Slurm's per-node counts, ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in text.split(","):
        m = _COUNT.match(part.strip())
        if m is None:
            raise ConfigError(f"cannot read Slurm's per-node count {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def allocation(environ: Mapping[str, str]) -> Allocation | None:
    """The allocation this process runs in (batch script or salloc shell), or None."""
    job, nodelist = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_JOB_NODELIST", "")
    if not job or not nodelist:
        return None
    tasks_in_step = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS", "1")
    if environ.get("SLURM_STEP_ID") and tasks_in_step.isdigit() and int(tasks_in_step) > 1:
        raise ConfigError(f"ringrun is running as one of {tasks_in_step} tasks of a Slurm job step; "
                          "run it once, from the batch script (not under 'srun -n N')")
    try:
        nodes = expand_slurm_nodelist(nodelist)
    except LaunchEnvError as exc:
        raise ConfigError(f"SLURM_JOB_NODELIST: {exc}") from None
    per_node = environ.get("SLURM_TASKS_PER_NODE") or environ.get("SLURM_JOB_CPUS_PER_NODE") or ""
    slots = expand_counts(per_node) if per_node else [1] * len(nodes)
    cpu_text = environ.get("SLURM_JOB_CPUS_PER_NODE", "")
    cpus = expand_counts(cpu_text) if cpu_text else []
    if len(slots) != len(nodes) or (cpus and len(cpus) != len(nodes)):
        raise ConfigError(f"Slurm lists {len(nodes)} node(s) ({nodelist}) but per-node counts "
                          f"{per_node!r}; pass -H to choose the hosts yourself")
    ntasks = environ.get("SLURM_NTASKS", "")
    return Allocation(
        job_id=job,
        hosts=tuple(Host(n, max(1, s)) for n, s in zip(nodes, slots, strict=False)),
        ntasks=int(ntasks) if ntasks.isdigit() else None,
        cpus=dict(zip(nodes, cpus, strict=False)),
    )


def srun_argv(node: str, python: str, agent: str, cpus: int | None = None) -> list[str]:
    """The job step that runs ``node``'s host agent (see the module docstring)."""
    argv = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap",
            "--cpu-bind=none", "--kill-on-bad-exit=0", "--quiet", "--mpi=none",
            "--job-name=ringrun-agent"]
    if cpus:
        argv.append(f"--cpus-per-task={cpus}")
    return [*argv, python, agent]
