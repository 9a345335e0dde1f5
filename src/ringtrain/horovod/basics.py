"""``hvd.init()`` and the questions about the job, with Horovod's names and answers.

``init`` joins the job through ``rt.init()`` (any launcher ringtrain reads: ringrun,
horovodrun, torchrun, mpirun, srun) and starts the coordinator
(:mod:`ringtrain.horovod._coordinator`) that runs Horovod's named, negotiated operations.
``shutdown`` stops both; ``init`` again works (Horovod's test suite does it per test).
The ``*_built``/``*_enabled`` answers describe this engine truthfully: Gloo always, NCCL
when torch has CUDA, no MPI, DDL or oneCCL.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ringtrain import runtime, wiring
from ringtrain.errors import ConfigError, NotInitializedError
from ringtrain.horovod._coordinator import Engine, ProcessSet
from ringtrain.horovod.stall import stall_limits
from ringtrain.horovod.timeline import start_from_env

__all__ = [
    "HorovodNotInitializedError", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "engine", "gloo_built", "gloo_enabled", "global_process_set", "init", "is_homogeneous",
    "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "rank", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]


class HorovodNotInitializedError(NotInitializedError, ValueError):
    """Horovod raises ValueError when asked before ``init()``; so does the drop-in."""


#: The whole job (``process_set_id`` 0), valid while initialised.
global_process_set = ProcessSet()

_engine: Engine | None = None
_atexit = False


def engine() -> Engine:
    if _engine is None:
        raise HorovodNotInitializedError("Horovod has not been initialized; use hvd.init().")
    return _engine


def _fusion_bytes() -> int:
    # HOROVOD_FUSION_THRESHOLD (bytes) as Horovod reads it, else ringtrain's fusion_mb.
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD", "")
    if raw.strip():
        try:
            return max(0, int(raw))
        except ValueError:
            raise ConfigError(f"HOROVOD_FUSION_THRESHOLD={raw!r} is not a number of bytes") from None
    return int(runtime.settings().fusion_mb * 1024 * 1024)


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Join the job and start the coordinator (again after ``shutdown()``).

    ``comm``: ``None``, or a list of ranks that is empty or names every rank (the whole
    job, as Horovod's Gloo controller takes any list); a subset, or an mpi4py
    communicator, needs MPI and is refused. ``process_sets``: process sets to register
    now (every rank passes the same list), or ``"dynamic"``. ``HOROVOD_GLOO_IFACE``
    chooses the network interface, as in Horovod (:func:`_gloo_iface`).
    """
    global _engine, _atexit
    ranks = _comm_ranks(comm)
    if _engine is not None:
        return
    _gloo_iface(os.environ)
    world = wiring.init()
    if ranks and sorted(set(ranks)) != list(range(world.env.size)):
        raise ConfigError(f"hvd.init(comm={ranks}) asks for a subset of the {world.env.size} ranks, "
                          "which needs MPI (not used here); call hvd.init() and use "
                          "hvd.add_process_set(ranks) for a subset")
    warning, limit = stall_limits(os.environ, world.settings.stall_timeout)
    _engine = Engine(
        world.env.rank, world.env.size, _connect if world.env.size > 1 else None,
        fusion_bytes=_fusion_bytes(), stall_timeout=limit, stall_warning=warning,
        cuda_backend="nccl" if world.backend == "nccl" else None,
        device=world.device,
    )
    global_process_set._bind(0, list(range(world.env.size)), world.env.rank, None)
    if process_sets is not None and not isinstance(process_sets, str):
        for ps in process_sets:
            _engine.add_process_set(ps)
    start_from_env(_engine)
    runtime.add_sever_hook(_world_over)
    if not _atexit:
        atexit.register(_at_exit)
        _watch_uncaught()
        _atexit = True


def _comm_ranks(comm: Any) -> list[int]:
    """The ranks ``hvd.init(comm=)`` names ([]: the whole job). Horovod takes a list of
    ranks (its Gloo controller ignores it: always the whole job) or an mpi4py
    communicator (which needs MPI, as a subset does)."""
    if comm is None:
        return []
    if isinstance(comm, (list, tuple, range)) and all(isinstance(r, int) and not isinstance(r, bool)
                                                      for r in comm):
        return list(comm)
    raise ConfigError(f"hvd.init(comm=<{type(comm).__name__}>) needs MPI, which this engine does not "
                      "use; call hvd.init() (or pass a list of every rank) and use "
                      "hvd.add_process_set(ranks) for subsets")


def _gloo_iface(environ: Any) -> None:
    """``HOROVOD_GLOO_IFACE`` (Horovod's Gloo context binds that interface; Horovod's
    horovodrun sets it from ``--network-interface``) as ``GLOO_SOCKET_IFNAME``, the name torch's Gloo
    reads. Unread, Gloo bound the interface the host name resolves to, which the other
    hosts may not reach. A name that is not an interface of this host is refused here:
    Horovod's init fails on it too, and torch's Gloo would fail later with less to go on."""
    name = str(environ.get("HOROVOD_GLOO_IFACE", "")).strip()
    if not name:
        return
    present = [n for _, n in socket.if_nameindex()]
    if name not in present:
        raise ConfigError(f"HOROVOD_GLOO_IFACE={name!r} is not a network interface of this host "
                          f"(it has {', '.join(present)}); set it to one of those, or unset it")
    environ["GLOO_SOCKET_IFNAME"] = name


def _world_over() -> None:
    # The launcher moved this rank to another world (a resizable job lost a rank): an
    # operation still waiting for a rank of the old one (Horovod's stall check sets no
    # limit) fails now, as one on a closed connection does, so hvd.elastic.run resets.
    eng = _engine
    if eng is not None:
        eng.fail_pending("the job changed size: this world is over")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome trace of the named operations; rank 0 writes ``file_path`` at
    ``stop_timeline()`` (format: :mod:`ringtrain.horovod._coordinator.trace`)."""
    engine().trace.start(file_path, mark_cycles)


def stop_timeline() -> None:
    engine().trace.stop()


def _connect() -> Any:
    store = runtime.connect_store()
    if store is None:  # pragma: no cover - only a 1-process world has none
        raise ConfigError("this job has no rendezvous store to connect to")
    return store


def shutdown() -> None:
    """Stop the coordinator (every rank) and leave the job; safe to call twice."""
    global _engine
    if _engine is None:
        return
    eng, _engine = _engine, None
    eng.trace.stop()
    eng.shutdown()
    global_process_set._unbind()
    wiring.shutdown()


def _at_exit() -> None:
    # A script that never calls hvd.shutdown(): stop the coordinator's thread before the
    # interpreter tears down the groups it is blocked on.
    # The shutdown is collective: a rank that is still training (a slower one, or one
    # writing a checkpoint) asks for it later, so wait as long as any exchange may.
    if _engine is None:
        return
    if _ending_on_an_exception():
        # The job is failing: the others are often waiting for this rank's next operation
        # and would not ask for the shutdown, so waiting for them held the failure for the
        # stall timeout (60 s). Horovod's ranks fail at once; leave without them, and the
        # launcher, seeing this rank's status, stops the rest.
        try:
            _engine.abort("a rank is exiting on an uncaught exception", timeout=2.0)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        if _engine._thread.is_alive():  # in the backend with a peer: no teardown (exit guard)
            runtime.mark_broken("a rank exited on an uncaught exception")
        return
    try:
        _engine.shutdown(timeout=max(runtime.settings().stall_timeout, 30.0))
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


_uncaught = False  # sys.excepthook saw the script's own exception (it is ending on it)


def _ending_on_an_exception() -> bool:
    """Whether the interpreter is exiting because the script raised. Not from
    ``sys.last_value``: pytest sets it for every failed test of a suite that goes on."""
    return _uncaught


def _watch_uncaught() -> None:
    """Note an exception the script did not catch, then report it as before (a script
    that sets its own ``sys.excepthook`` later keeps the waiting shutdown)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        global _uncaught
        _uncaught = True
        previous(kind, value, tb)

    sys.excepthook = hook


def is_initialized() -> bool:
    return _engine is not None


def _env() -> Any:
    engine()
    return runtime.world().env


def rank() -> int:
    return int(_env().rank)


def size() -> int:
    return int(_env().size)


def local_rank() -> int:
    return int(_env().local_rank)


def local_size() -> int:
    return int(_env().local_size)


def _cross() -> list[int]:
    # Horovod's cross communicator joins the ranks with this rank's local rank, one per
    # host, in rank order (its Gloo launcher's HOROVOD_CROSS_RANK, MPI_Comm_split by
    # local rank). On hosts with different rank counts it is not every host: with hosts
    # a:2, b:1, local rank 1 is on a only, so its cross size is 1; the launch
    # environment's cross rank/size (a host's index, the number of hosts) said 2 there.
    eng, me = engine(), rank()
    mine = eng.places[me][0]
    return [r for r, (local, _) in enumerate(eng.places) if local == mine]


def cross_rank() -> int:
    """This rank's index among the ranks with its local rank (one per host)."""
    return _cross().index(rank())


def cross_size() -> int:
    """How many hosts run a rank with this rank's local rank."""
    return len(_cross())


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks (the same answer on every rank,
    from every rank's local size, as Horovod's controllers compute it; local size times
    the number of hosts equal to the job's size said True on some ranks of hosts
    a:1, b:2, c:3)."""
    sizes = {local_size for _, local_size in engine().places}
    return len(sizes) == 1


def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """A ValueError, as Horovod's on a build without MPI (its Gloo build): there is no
    MPI to mix with mpi4py, and a script that checks (Horovod's docs: ``assert
    hvd.mpi_threads_supported()`` before using mpi4py) fails as it does there."""
    raise ValueError("Horovod MPI is not enabled (this engine runs on torch.distributed, without "
                     "MPI), so there are no MPI threads; check hvd.mpi_enabled() first")


def gloo_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return True


def nccl_built() -> int:
    """The NCCL version as Horovod encodes it (2.7.8 -> 2708), or 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CUDA build without NCCL
        return 0
    if isinstance(version, tuple):
        major, minor, patch = (list(version) + [0, 0, 0])[:3]
        return int(major) * 1000 + int(minor) * 100 + int(patch)
    return int(version)


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None
