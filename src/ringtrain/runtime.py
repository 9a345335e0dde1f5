"""Process-wide runtime: join the job, pin a device, answer who-am-I questions.

``init()`` reads the launch environment once (:func:`ringtrain.env.parse_env`),
rendezvouses through a TCP store (or an in-memory one for a 1-process world), starts
the ``torch.distributed`` process group and pins ``cuda:<local_rank>`` when CUDA is
there. Everything else in ringtrain asks this module for the world.

A resizable job (``ringrun --min-np/--max-np``) moves from world to world in one
process: :func:`abandon` leaves a world whose peers may be gone, :func:`assign` names
the next one (ringrun's assignment), and :func:`init` joins it. Each of its processes
hosts a store server of its own on the port ringrun reserved for it (any survivor may
become rank 0), kept for the process's life; every world rendezvouses under its own
key prefix.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtrain import addresses, assignment, inflight, lingering, sockets
from ringtrain import sever as sever_mod
from ringtrain.env import LaunchEnv, parse_env
from ringtrain.errors import ConfigError, LaunchEnvError, NotInitializedError, first_line, rank_list
from ringtrain.settings import Settings, load_settings
from ringtrain.signing import Signer

__all__ = [
    "World",
    "abandon",
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

log = logging.getLogger("ringtrain")

@dataclass(frozen=True)
class World:
    """The job as this process sees it after :func:`init`."""

    env: LaunchEnv
    backend: str
    device: torch.device
    settings: Settings
    #: False when the script had initialised torch.distributed itself (it ends the group).
    owns_group: bool = True


_world: World | None = None
_store: dist.Store | None = None
_base_store: tuple[tuple[object, ...], dist.Store] | None = None
_generation = 0
_store_prefix = ""
_broken: str | None = None
_exit_guard_registered = False
_shutdown_hooks: list[Callable[[], None]] = []
#: A resizable job: the launch variables of the world to join next (see assign()), this
#: process's own store server and its port, the sockets it had before (never severed),
#: and whether GLOO_SOCKET_IFNAME was set by init() (then each world picks its own).
_assigned: dict[str, str] = {}
_own_server: dist.TCPStore | None = None
_own_port: int | None = None
_spared: frozenset[int] = frozenset()
_gloo_iface_ours = False


def signer() -> Signer:
    """Seals what ringtrain writes to the store with the job's secret (:mod:`ringtrain.signing`)."""
    return Signer(world().env.secret if _world is not None else "")


def mark_broken(reason: str) -> None:
    """A collective failed because a peer stopped or vanished mid-exchange.

    The process groups cannot be torn down cleanly any more: Gloo's destructor joins a
    thread that is blocked receiving from that peer, for up to the init timeout (300 s),
    so a rank that raised a StallError would linger instead of ending the job. From now
    on :func:`shutdown` skips the teardown, and at exit the process leaves at once (after
    the other exit handlers ran: timeline and doctor reports are still written) with
    status 1, so the launcher stops the job and can restart it.
    """
    global _broken
    if _broken is None:
        _broken = reason
        log.debug("process groups marked broken: %s", reason)


def _exit_guard() -> None:
    if _broken is None:
        if _world is not None:
            # Left without shutdown(): release what the layers above hold (exchange
            # groups and their threads, stall reporting) now, while their threads can
            # still be joined. The process group itself is left as torch leaves it.
            _run_hooks_leniently("exit")
        # The backend's threads must let go of our tensors while the interpreter can
        # still take their decrefs (see ringtrain.inflight).
        inflight.drain()
        # No thread of ours may be inside a backend call once finalization starts
        # (see ringtrain.lingering): one that does not finish in time makes this a
        # clean exit with status 1 rather than an abort.
        wait_s = _exit_wait_s()
        stuck = lingering.settle(wait_s)
        if not stuck:
            return
        print(f"ringtrain: thread(s) {', '.join(stuck)} still inside a backend call at exit "
              f"after {wait_s:.0f} s (a peer or rank 0's store does not answer); "
              "leaving with status 1 instead of aborting", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing more to write
            pass
    os._exit(1)


def _run_hooks_leniently(when: str) -> None:
    """The shutdown hooks, for a world that is over either way: a failing one is logged."""
    for fn in list(_shutdown_hooks):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the world is gone whatever it raised
            log.debug("%s: shutdown hook failed (%s)", when, exc)


def _exit_wait_s() -> float:
    """How long exit waits for ringtrain's threads: as long as an exchange may wait
    (rank 0's store answers from a thread of its own even while its script is busy, so
    only a frozen or vanished rank 0 makes this wait)."""
    stall = _world.settings.stall_timeout if _world is not None else 0.0
    return max(5.0, stall)


def add_shutdown_hook(fn: Callable[[], None]) -> None:
    """Run ``fn`` in :func:`shutdown` before the process group goes (layers below the
    runtime, such as the exchange strategies, release their groups and threads here)."""
    if fn not in _shutdown_hooks:
        _shutdown_hooks.append(fn)


def _choose_backend(requested: str, local_size: int) -> str:
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise ConfigError(
                "backend 'nccl' needs CUDA GPUs but none is available; use backend='gloo' or 'auto'"
            )
        return requested
    # NCCL only when every process on this host can own a GPU: sharing one GPU
    # between NCCL ranks is unsupported (ncclInvalidUsage).
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_size:
        return "nccl"
    return "gloo"


def _store_listener(env: LaunchEnv) -> int:
    """The listening descriptor for rank 0's store: ringrun's reservation (inherited), or
    a socket bound here on ``MASTER_ADDR`` only.

    TCPStore on its own binds every interface; a job confined to one host must not be
    reachable from the network (see :mod:`ringtrain.sockets`).
    """
    assert env.master_port is not None  # guaranteed by LaunchEnv validation
    try:
        if env.store_fd is not None:
            return sockets.listen_on(env.store_fd)
        sock = sockets.reserve(env.master_addr, env.master_port)
        try:
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        return sock.detach()  # the store owns the descriptor now
    except OSError as exc:
        raise LaunchEnvError(
            f"cannot listen on {env.master_addr}:{env.master_port} for the rendezvous "
            f"({exc.strerror}); choose another MASTER_PORT (or let ringrun pick one)"
        ) from None


def _make_store(env: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    global _base_store, _generation
    if env.elastic_file:
        return _elastic_store(env, timeout)
    if env.size == 1 and env.master_port is None:
        return dist.HashStore()
    assert env.master_port is not None  # guaranteed by LaunchEnv validation
    key = (env.master_addr, env.master_port, env.rank, env.size, env.run_id, env.attempt)
    if _base_store is None or _base_store[0] != key:
        if env.rank == 0 and not env.agent_store:
            base = dist.TCPStore(
                env.master_addr, env.master_port, env.size, True, timeout=timeout,
                wait_for_workers=False, master_listen_fd=_store_listener(env),
            )
        else:
            try:
                base = dist.TCPStore(env.master_addr, env.master_port, env.size, False, timeout=timeout)
            except RuntimeError as exc:
                raise LaunchEnvError(
                    f"rank {env.rank} cannot reach rank 0's rendezvous at {env.master_addr}:"
                    f"{env.master_port} within {timeout.total_seconds():g} s ({first_line(exc)}); check "
                    "MASTER_ADDR/MASTER_PORT and that rank 0 started (RINGTRAIN_INIT_TIMEOUT sets the wait)"
                ) from None
        # Kept for the life of the process: init -> shutdown -> init again (Horovod's
        # suites do it every test) reuses the connection and, on rank 0, the server, so
        # no rank can reach a store that is going away.
        _base_store = (key, base)
        _generation = 0
    else:
        _generation += 1
    # Each restart attempt (and each init of this process) rendezvouses under its own
    # prefix so no key of an earlier one is ever read (FIELD-NOTES: torchrun restarts
    # hung on stale addresses).
    return dist.PrefixStore(_set_prefix(f"ringtrain/{env.run_id}/{env.attempt}/{_generation}/"),
                            _base_store[1])


def _elastic_store(env: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """A resizable job's store: this process's own server when it is rank 0, else a new
    connection to rank 0's; the prefix names the world (``.../v<version>/<generation>/``)."""
    global _base_store, _generation, _own_server, _own_port, _spared
    assert env.master_port is not None  # guaranteed by LaunchEnv validation
    if _own_server is None and env.store_fd is not None:
        before = set(sever_mod.socket_inodes())
        reserved = socket.socket(fileno=env.store_fd)
        addr, port = reserved.getsockname()[:2]
        reserved.detach()
        try:
            _own_server = dist.TCPStore(str(addr), int(port), None, True, timeout=timeout,
                                        wait_for_workers=False,
                                        master_listen_fd=sockets.listen_on(env.store_fd))
        except (OSError, RuntimeError) as exc:
            raise LaunchEnvError(f"cannot serve this worker's rendezvous on {addr}:{port} ({exc}); "
                                 "ringrun reserved it, so another process took it") from None
        _own_port = int(port)
        # Never severed (see sever()): what existed before (the script's own connections)
        # and the server's connection to itself, made just now.
        _spared = frozenset(before | set(sever_mod.socket_inodes()))
    key = ("elastic", env.master_addr, env.master_port, env.version, env.run_id, env.attempt)
    if _base_store is None or _base_store[0] != key:
        try:
            base = dist.TCPStore(env.master_addr, env.master_port, env.size, False, timeout=timeout)
        except RuntimeError as exc:
            raise LaunchEnvError(
                f"rank {env.rank} cannot reach rank 0's rendezvous of world {env.version} at "
                f"{env.master_addr}:{env.master_port} ({first_line(exc)})") from None
        _base_store = (key, base)
        _generation = 0
    else:
        _generation += 1
    return dist.PrefixStore(
        _set_prefix(f"ringtrain/{env.run_id}/{env.attempt}/v{env.version}/{_generation}/"), _base_store[1])


def _acknowledge(env: LaunchEnv) -> None:
    """Tell ringrun this process has joined world ``env.version`` (a resizable job)."""
    try:
        assignment.write_ack(env.elastic_file, env.version)
    except OSError as exc:  # ringrun then never sees the world form: it does not grow it
        log.warning("cannot write %s: %s", assignment.ack_path(env.elastic_file), exc.strerror)


def assign(overlay: Mapping[str, str]) -> None:
    """Make the next :func:`init` join the world ``overlay`` describes: launch variables
    laid over the process's environment (a resizable job's next world, as ringrun wrote
    it, see :mod:`ringtrain.assignment`). Call it while not initialised."""
    global _gloo_iface_ours
    if _world is not None:
        raise ConfigError("runtime.assign() while initialised: leave the world first "
                          "(shutdown() or abandon())")
    _assigned.clear()
    _assigned.update(overlay)
    if _gloo_iface_ours:  # chosen for the last world's rank 0: choose again for this one
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
        _gloo_iface_ours = False


def sever(addresses: Collection[str]) -> int:
    """Shut down this process's connections to ``addresses`` (a resizable job leaving a
    world), so nothing of the world waits on a peer that vanished. Spared: the
    connections the script had before it joined, and those of this process's own store
    server (other worlds' ranks use it). Returns how many were shut down."""
    if not addresses:
        return 0
    # Connections other processes made to this one's server stay: a later world's ranks
    # may be connecting to it while this runs (so the port is checked per connection,
    # not from a list taken earlier).
    keep = () if _own_port is None else (_own_port,)
    return sever_mod.sever(addresses, keep_local_ports=keep, spare=_spared)


def abandon() -> None:
    """Leave the world without waiting for its peers (a resizable job re-forming after a
    loss, or growing). Call :func:`sever` on the world's addresses first: then no thread
    of the old groups waits on a peer, and they are destroyed at once. Clears the broken
    mark, so the next :func:`init` (after :func:`assign`) starts clean."""
    global _world, _store, _broken
    if _world is not None:
        _run_hooks_leniently("abandon")
        if _world.owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - as above
                log.debug("abandon: destroying the groups failed (%s)", exc)
    _world = None
    _store = None
    _broken = None


def _set_prefix(prefix: str) -> str:
    global _store_prefix
    _store_prefix = prefix
    return prefix


def connect_store() -> dist.Store | None:
    """A new connection to this job's store, under the current prefix (None in a
    1-process world without a store). For threads that block in ``store.wait``: one
    client connection serialises every call made on it."""
    w = world()
    env = w.env
    if env.master_port is None or env.size == 1:
        return None
    timeout = datetime.timedelta(seconds=w.settings.init_timeout)
    client = dist.TCPStore(env.master_addr, env.master_port, env.size, False, timeout=timeout)
    return dist.PrefixStore(_store_prefix, client)


def _configure_logging(env: LaunchEnv) -> None:
    # One handler for the "ringtrain" logger with the rank in every line, added once.
    if any(getattr(h, "_ringtrain", False) for h in log.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[ringtrain rank {env.rank}] %(levelname)s %(message)s"))
    handler._ringtrain = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.WARNING)
    log.propagate = False


def init(backend: str | None = None, timeout: float | None = None) -> World:
    """Join the job described by the environment; a no-launcher run is a 1-process world.

    Calling it again while initialised returns the current world.
    """
    global _world, _store
    if _world is not None:
        return _world
    global _exit_guard_registered
    cfg = load_settings(backend=backend, init_timeout=timeout)
    env = parse_env({**os.environ, **_assigned} if _assigned else os.environ)
    _configure_logging(env)
    if not _exit_guard_registered:
        # Registered first, so it runs last among the exit handlers (they run in reverse).
        atexit.register(_exit_guard)
        _exit_guard_registered = True
    if dist.is_initialized():
        _world, _store = _join_existing(env, cfg)
        return _world
    chosen = _choose_backend(cfg.backend, env.local_size)
    if chosen == "gloo" and env.gloo_interface is None:
        # Gloo binds the address the host name resolves to, which may be 127.0.1.1 or
        # an interface the other hosts cannot reach (seen under srun). Confine a one-host
        # job to loopback, so nothing listens on the network; across hosts, use the
        # interface that routes to rank 0. (Gloo reads only the variable.)
        iface = "lo" if addresses.is_loopback(env.master_addr) else addresses.interface_towards(env.master_addr)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
            global _gloo_iface_ours
            _gloo_iface_ours = True
    pg_timeout = datetime.timedelta(seconds=cfg.init_timeout)
    store = _make_store(env, pg_timeout)
    _await_everyone(store, env, cfg.init_timeout)
    dev = _pin_device(env)
    dist.init_process_group(chosen, store=store, rank=env.rank, world_size=env.size, timeout=pg_timeout)
    _store = store
    _world = World(env=env, backend=chosen, device=dev, settings=cfg, owns_group=True)
    log.info("joined %s world of %d (backend %s, device %s)", env.launcher, env.size, chosen, dev)
    if env.elastic_file:
        _acknowledge(env)
    return _world


def _await_everyone(store: dist.Store, env: LaunchEnv, timeout_s: float) -> None:
    """Every rank checks in before the process group forms, so a rank that never comes
    is named (torch would fail after the timeout with a store error that names none).

    Rank 0 waits for every rank's key and publishes the outcome; the others wait for
    that outcome, so they name the missing ranks too (reading the keys themselves would
    race with rank 0, which hosts the store, exiting)."""
    if env.size == 1:
        return
    seal = Signer(env.secret)
    store.set(f"joined/{env.rank}", seal.seal(f"joined/{env.rank}", "1"))
    if env.rank == 0:
        keys = [f"joined/{r}" for r in range(env.size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
            missing = [r for r, k in enumerate(keys) if seal.open(k, store.get(k)) != "1"]
        except RuntimeError:
            missing = [r for r, k in enumerate(keys)
                       if not store.check([k]) or seal.open(k, store.get(k)) != "1"]
        outcome = ",".join(map(str, missing)) if missing else "ok"
        store.set("joined/outcome", seal.seal("joined/outcome", outcome))
        if not missing:
            return
        time.sleep(2.0)  # let the ranks that came read it before the store goes
    else:
        try:
            store.wait(["joined/outcome"], datetime.timedelta(seconds=timeout_s + 10.0))
            outcome = seal.open("joined/outcome", store.get("joined/outcome")) or "unsealed"
        except RuntimeError:
            raise LaunchEnvError(
                f"rank 0 (which hosts the rendezvous at {env.master_addr}:{env.master_port}) "
                f"did not confirm the job within {timeout_s:g} s and is gone; its log names "
                "the ranks that never joined"
            ) from None
        if outcome == "ok":
            return
        if outcome == "unsealed":
            raise LaunchEnvError(
                f"the rendezvous outcome in the store at {env.master_addr}:{env.master_port} was "
                "not written by this job (someone else wrote to its store); see docs/launch.md"
            )
        missing = [int(r) for r in outcome.split(",") if r]
    raise LaunchEnvError(
        f"rank(s) {rank_list(missing)} of {env.size} did not join the job at {env.master_addr}:{env.master_port} "
        f"within {timeout_s:g} s; look at their logs (did they start? do they see the same "
        "MASTER_ADDR/MASTER_PORT?) or raise RINGTRAIN_INIT_TIMEOUT"
    )


def _pin_device(env: LaunchEnv) -> torch.device:
    if torch.cuda.is_available() and torch.cuda.device_count() > env.local_rank:
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def _join_existing(env: LaunchEnv, cfg: Settings) -> tuple[World, dist.Store]:
    """The script called ``torch.distributed.init_process_group()`` itself (as scripts
    written for torchrun do): use that group and its store instead of a second rendezvous."""
    if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.size):
        raise LaunchEnvError(
            f"torch.distributed was initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but the launcher says rank {env.rank} of {env.size}; "
            "call rt.init() before init_process_group(), or pass the launcher's RANK and WORLD_SIZE"
        )
    from torch.distributed.distributed_c10d import _get_default_store

    store = dist.PrefixStore(_set_prefix(f"ringtrain/{env.run_id}/{env.attempt}/joined/"),
                             _get_default_store())
    backend = str(dist.get_backend())
    dev = _pin_device(env)
    world = World(env=env, backend=backend, device=dev, settings=cfg, owns_group=False)
    log.info("joined the existing %s group of %d (device %s)", backend, env.size, dev)
    return world, store


def shutdown() -> None:
    """Leave the job; safe to call twice or without :func:`init`."""
    global _world, _store
    if _world is None:
        return
    if _broken is not None:
        # A peer is gone mid-exchange: tearing the groups down would wait for it.
        _world = None
        _store = None
        return
    for fn in list(_shutdown_hooks):
        fn()
    inflight.drain()
    if _world.owns_group and dist.is_initialized():
        dist.destroy_process_group()  # a group the script made itself is the script's to end
    if _world.owns_group and _world.env.size > 1 and _store is not None:
        _wait_for_everyone_to_leave(_store, _world)
    _world = None
    _store = None


def _wait_for_everyone_to_leave(store: dist.Store, w: World) -> None:
    """Rank 0 hosts the rendezvous store: it must outlive every rank's process group.

    If rank 0 exits while another rank still tears its Gloo group down, that rank's
    connection to the store breaks under a C++ thread and the process aborts
    ("terminate called without an active exception", seen 1 run in 6 of a 4-rank job).
    So every rank reports that it has left, and rank 0 waits (bounded) for all of them.
    """
    seal = Signer(w.env.secret)
    try:
        key = f"shutdown/left/{w.env.rank}"
        store.set(key, seal.seal(key, "1"))
        if w.env.rank != 0:
            return
        deadline = time.monotonic() + min(30.0, w.settings.init_timeout)
        waiting = set(range(1, w.env.size))
        while waiting and time.monotonic() < deadline:
            for r in list(waiting):
                k = f"shutdown/left/{r}"
                if store.check([k]) and seal.open(k, store.get(k)) == "1":
                    waiting.discard(r)
            if waiting:
                time.sleep(0.01)
    except (RuntimeError, OSError) as exc:  # a rank already gone: nothing left to protect
        log.debug("shutdown: store no longer reachable (%s)", exc)


def is_initialized() -> bool:
    return _world is not None


def job_world() -> tuple[int, int, int]:
    """(rank, size, processes on this host) of the job this process is in, for the parts
    that work without ``rt.init()`` (the loader's shard, the learning-rate rule).

    ringtrain's world after ``rt.init()``; else a process group the script started
    itself (``torch.distributed.init_process_group``, a torchrun script that uses
    ``rt.data.Loader`` or ``rt.scale_lr`` without ``rt.init()``: taken for one process,
    every rank read the whole dataset); else one process.
    """
    if _world is not None:
        return _world.env.rank, _world.env.size, _world.env.local_size
    if dist.is_available() and dist.is_initialized():
        try:
            local = parse_env(os.environ).local_size
        except Exception:  # only the CPU budget's share: an odd environment is one process
            local = 1
        return dist.get_rank(), dist.get_world_size(), local
    return 0, 1, 1


def world() -> World:
    if _world is None:
        raise NotInitializedError("ringtrain is not initialised; call rt.init() first")
    return _world


def store() -> dist.Store:
    """The rendezvous store of this attempt (used for stall checks and signatures)."""
    world()
    assert _store is not None
    return _store


def settings() -> Settings:
    return world().settings if _world is not None else load_settings()


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
    """``cuda:<local_rank>`` when this process has a GPU, else ``cpu`` (works before init)."""
    if _world is not None:
        return _world.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
