"""Process-wide runtime: join the job, pin a device, answer who-am-I questions.

``init()`` reads the launch environment once (:func:`ringtrain.env.parse_env`),
rendezvouses through the job's store (:mod:`.rendezvous`; an in-memory one for a
1-process world), starts the ``torch.distributed`` process group and pins
``cuda:<local_rank>`` when CUDA is there. Everything else in ringtrain asks this module
for the world.

The state lives in one object, :data:`~.membership.MEMBERSHIP` (:mod:`.membership`);
the functions here are thin reads of it and the calls that change it. A resizable job
(``ringrun --min-np/--max-np``) moves from world to world in one process: :func:`abandon`
leaves a world whose peers may be gone, :func:`assign` names the next one (ringrun's
assignment), and :func:`init` joins it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping

import torch
import torch.distributed as dist

from ringtrain.env import parse_env
from ringtrain.runtime.membership import MEMBERSHIP, World
from ringtrain.settings import Settings, load_settings
from ringtrain.signing import Signer

__all__ = [
    "World",
    "abandon",
    "add_sever_hook",
    "add_shutdown_hook",
    "assign",
    "mark_broken",
    "connect_store",
    "cross_rank",
    "cross_size",
    "device",
    "init",
    "is_initialized",
    "job_world",
    "launched_world",
    "local_rank",
    "local_size",
    "rank",
    "settings",
    "sever",
    "shutdown",
    "signer",
    "size",
    "store",
    "world",
]


# -- changing the membership ------------------------------------------------------------------


def init(backend: str | None = None, timeout: float | None = None) -> World:
    """Join the job described by the environment; a no-launcher run is a 1-process world.

    Calling it again while initialised returns the current world.
    """
    return MEMBERSHIP.join(backend, timeout)


def shutdown() -> None:
    """Leave the job; safe to call twice or without :func:`init`."""
    MEMBERSHIP.leave()


def abandon() -> None:
    """Leave the world without waiting for its peers (see :meth:`.Membership.abandon`)."""
    MEMBERSHIP.abandon()


def assign(overlay: Mapping[str, str]) -> None:
    """Make the next :func:`init` join the world ``overlay`` describes (see
    :meth:`.Membership.assign`). Call it while not initialised."""
    MEMBERSHIP.assign(overlay)


def sever(addresses: Collection[str]) -> int:
    """Shut down this process's connections to ``addresses`` (see :meth:`.Membership.sever`)."""
    return MEMBERSHIP.sever(addresses)


def mark_broken(reason: str) -> None:
    """A peer vanished mid-exchange (see :meth:`.Membership.mark_broken`)."""
    MEMBERSHIP.mark_broken(reason)


def add_sever_hook(fn: Callable[[], None]) -> None:
    """Run ``fn`` after :func:`sever` (see :meth:`.Membership.add_sever_hook`)."""
    MEMBERSHIP.add_sever_hook(fn)


def add_shutdown_hook(fn: Callable[[], None]) -> None:
    """Run ``fn`` in :func:`shutdown` before the process group goes."""
    MEMBERSHIP.add_shutdown_hook(fn)


def connect_store() -> dist.Store | None:
    """A new connection to this job's store, under the current prefix (None in a
    1-process world without a store). For threads that block in ``store.wait``: one
    client connection serialises every call made on it."""
    return MEMBERSHIP.connect_store()


# -- reading it -------------------------------------------------------------------------------


def world() -> World:
    return MEMBERSHIP.current()


def is_initialized() -> bool:
    return MEMBERSHIP.world is not None


def store() -> dist.Store:
    """The rendezvous store of this attempt (used for stall checks and signatures)."""
    world()
    assert MEMBERSHIP.store is not None
    return MEMBERSHIP.store


def signer() -> Signer:
    """Seals what ringtrain writes to the store with the job's secret (:mod:`ringtrain.signing`)."""
    w = MEMBERSHIP.world
    return Signer(w.env.secret if w is not None else "")


def settings() -> Settings:
    w = MEMBERSHIP.world
    return w.settings if w is not None else load_settings()


def rank() -> int:
    return world().env.rank


def size() -> int:
    return world().env.size


def local_rank() -> int:
    return world().env.local_rank


def local_size() -> int:
    return world().env.local_size


def cross_rank() -> int:
    return world().env.cross_rank


def cross_size() -> int:
    return world().env.cross_size


def device() -> torch.device:
    """``cuda:<local_rank>`` when this process has a GPU, else ``cpu`` (works before init).

    Before ``rt.init()``: the CUDA device the script made current once it has used CUDA
    (``torch.cuda.set_device``), else ``cuda:$LOCAL_RANK`` (torchrun's and ringrun's
    variable), as DeviceMesh picks it: the current device of a process that has not
    chosen one is 0, which put every rank's batches on the first GPU."""
    w = MEMBERSHIP.world
    if w is not None:
        return w.device
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK", "")
    if not torch.cuda.is_initialized() and local.isdigit() and int(local) < torch.cuda.device_count():
        return torch.device("cuda", int(local))
    return torch.device("cuda", torch.cuda.current_device())


def job_world() -> tuple[int, int, int]:
    """(rank, size, processes on this host) of the job this process is in, for the parts
    that work without ``rt.init()`` (the loader's shard, the learning-rate rule).

    ringtrain's world after ``rt.init()``; else a process group the script started
    itself (``torch.distributed.init_process_group``, a torchrun script that uses
    ``rt.data.Loader`` or ``rt.scale_lr`` without ``rt.init()``: taken for one process,
    every rank read the whole dataset); else one process.
    """
    w = MEMBERSHIP.world
    if w is not None:
        return w.env.rank, w.env.size, w.env.local_size
    if dist.is_available() and dist.is_initialized():
        try:
            local = parse_env(os.environ).local_size
        except Exception:  # only the CPU budget's share: an odd environment is one process
            local = 1
        return dist.get_rank(), dist.get_world_size(), local
    return 0, 1, 1


def launched_world() -> tuple[int, int, str] | None:
    """(rank, size, launcher) of the job of several processes that the launch
    environment names (ringrun, torchrun, mpirun, srun), whether or not this process
    joined it; None for one process or an environment ``rt.init()`` would refuse (that
    is for ``rt.init()`` to report). Lets the parts that work without ``rt.init()`` see
    that they were launched into a job they did not join."""
    try:
        env = parse_env(os.environ)
    except Exception:  # noqa: BLE001 - any odd environment: rt.init() says what is wrong
        return None
    return (env.rank, env.size, env.launcher) if env.size > 1 else None
