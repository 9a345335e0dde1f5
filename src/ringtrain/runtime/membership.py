"""The world object: this process's place in the job, and the one thing that changes it.

:class:`Membership` owns what the process knows about the job it is in: the
:class:`World` it joined (rank, size, device, settings), the store of that world
(:class:`~ringtrain.runtime.rendezvous.Rendezvous`, with the generation and key prefix),
whether the world broke under it, and the shutdown hooks of the layers above. Its
methods are the only ways in and out:

=====================  ==========================================================
``join()``             read the launch environment (or the assigned world), rendezvous,
                       start the process group, pin the device (``rt.init()``)
``leave()``            end the world cleanly, waiting for the others (``rt.shutdown()``)
``abandon()``          leave a world whose peers may be gone, without waiting
``assign(overlay)``    name the next world (a resizable job's assignment from ringrun)
``sever(addresses)``   shut this process's connections to those hosts
``mark_broken()``      a peer vanished mid-exchange: no teardown, exit with status 1
=====================  ==========================================================

:data:`MEMBERSHIP` is the process's one instance; :mod:`ringtrain.runtime` reads it
(``rt.rank()`` is ``MEMBERSHIP.world.env.rank``).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing
import os
import socket
import sys
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ringtrain import assignment, inflight
from ringtrain import sever as sever_mod
from ringtrain.env import LaunchEnv, from_group, parse_env, rendezvous_without_rank
from ringtrain.errors import ConfigError, LaunchEnvError, NotInitializedError, rank_list
from ringtrain.runtime import backend
from ringtrain.runtime.rendezvous import Rendezvous, await_everyone, tcp_store_of, wait_for_everyone_to_leave
from ringtrain.settings import Settings, load_settings

__all__ = ["MEMBERSHIP", "Membership", "World"]

log = logging.getLogger("ringtrain")


@dataclass(frozen=True)
class World:
    """The job as this process sees it after ``rt.init()``."""

    env: LaunchEnv
    backend: str
    device: torch.device
    settings: Settings
    #: False when the script had initialised torch.distributed itself (it ends the group).
    owns_group: bool = True


class Membership:
    """This process's place in the job (see the module docstring)."""

    def __init__(self) -> None:
        self.world: World | None = None
        self.store: dist.Store | None = None
        #: Why the process groups cannot be torn down any more (None: they can).
        self.broken: str | None = None
        self.rendezvous = Rendezvous()
        self._hooks: list[Callable[[], None]] = []
        self._sever_hooks: list[Callable[[], None]] = []
        self._exit_guard_registered = False
        #: A resizable job: the launch variables of the world to join next (see assign()),
        #: and whether GLOO_SOCKET_IFNAME was set by join() (then each world picks its own).
        self._assigned: dict[str, str] = {}
        self._gloo_iface_ours = False
        #: The default group this world is on, the script's own or the one join() made
        #: (weak: the script's destroy_process_group() must free it, and its store with it).
        self._group: weakref.ref[Any] | None = None

    # -- reads -----------------------------------------------------------------------------

    def current(self) -> World:
        if self.world is None:
            raise NotInitializedError("ringtrain is not initialised; call rt.init() first")
        return self.world

    @property
    def generation(self) -> int:
        """How many times this process has joined through the same store connection."""
        return self.rendezvous.generation

    # -- joining ---------------------------------------------------------------------------

    def join(self, backend_name: str | None = None, timeout: float | None = None) -> World:
        """Join the job described by the environment (laid over with the assigned world);
        a no-launcher run is a 1-process world. Joined already: the current world."""
        if self.world is not None:
            if not self._group_gone():
                return self.world
            # The script destroyed the group this world was on (a second phase of a job:
            # destroy_process_group(), then init_process_group() and rt.init(), or
            # rt.init() alone, as the DDP tutorials' cleanup() ends a phase): what the
            # layers above hold of it goes, and the process joins what is there now.
            log.info("the process group rt.init() joined is gone (destroy_process_group()): joining anew")
            self._run_hooks_leniently("re-init")
            inflight.drain()
            self._forget_world()
        cfg = load_settings(backend=backend_name, init_timeout=timeout)
        environ = {**os.environ, **self._assigned} if self._assigned else os.environ
        env = parse_env(environ)
        backend.configure_logging(env, cfg)
        if not self._exit_guard_registered:
            # Registered first, so it runs last among the exit handlers (they run in reverse).
            atexit.register(self._exit_guard)
            self._exit_guard_registered = True
        if dist.is_initialized():
            self.world, self.store = self._join_existing(env, cfg, backend_name)
            return self.world
        if rendezvous_without_rank(environ) and multiprocessing.parent_process() is not None:
            # mp.spawn(main, nprocs=world_size) with MASTER_ADDR/MASTER_PORT, as the DDP
            # tutorials start their processes: no variable says which rank this is, so
            # every process would train alone as rank 0 of 1.
            raise LaunchEnvError(
                "rt.init() in a process started by multiprocessing (mp.spawn?) finds MASTER_ADDR/"
                "MASTER_PORT but no RANK/WORLD_SIZE, so it would be a 1-process world; set "
                "os.environ['RANK'] and os.environ['WORLD_SIZE'] before rt.init(), or call "
                "dist.init_process_group(backend, rank=rank, world_size=world_size) first")
        chosen = backend.choose_backend(cfg.backend, env)
        if chosen == "gloo":
            iface = backend.gloo_interface(env)
            if iface:
                os.environ["GLOO_SOCKET_IFNAME"] = iface
                self._gloo_iface_ours = True
        pg_timeout = datetime.timedelta(seconds=cfg.init_timeout)
        store = self.rendezvous.open(env, pg_timeout)
        await_everyone(store, env, cfg.init_timeout)
        dev = backend.pin_device(env)
        # NCCL's operations are bounded by its watchdog, which must not fire before the
        # stall check (see backend.nccl_op_timeout); Gloo's by the init timeout, as before.
        op_timeout = (datetime.timedelta(seconds=backend.nccl_op_timeout(cfg)) if chosen == "nccl"
                      else pg_timeout)
        dist.init_process_group(chosen, store=store, rank=env.rank, world_size=env.size, timeout=op_timeout)
        self.store = store
        self._group = _default_group_ref()
        self.world = World(env=env, backend=chosen, device=dev, settings=cfg, owns_group=True)
        log.info("joined %s world of %d (backend %s, device %s)", env.launcher, env.size, chosen, dev)
        if env.elastic_file:
            self._acknowledge(env)
        return self.world

    def _join_existing(self, env: LaunchEnv, cfg: Settings,
                       requested: str | None) -> tuple[World, dist.Store]:
        """The script called ``torch.distributed.init_process_group()`` itself (as scripts
        written for torchrun do): use that group and its store instead of a second rendezvous.

        Without a launcher (``mp.spawn`` and ``init_process_group(rank=, world_size=)``,
        the DDP tutorials' pattern) the group says who this process is; the local ranks
        come from the ranks' host names, exchanged through the group's store."""
        rank, size = dist.get_rank(), dist.get_world_size()
        if env.launcher != "none" and (rank, size) != (env.rank, env.size):
            raise LaunchEnvError(
                f"torch.distributed was initialised as rank {rank} of {size}, but the launcher "
                f"({env.launcher}) says rank {env.rank} of {env.size}; call rt.init() before "
                "init_process_group(), or pass the launcher's RANK and WORLD_SIZE"
            )
        store = self.rendezvous.joined_existing(env)
        if env.launcher == "none" and size > 1:
            env = parse_group(env, store, rank, size, cfg.init_timeout)
        dev = backend.pin_device(env)
        name = backend.existing_backend(str(dist.get_backend()), dist.get_backend_config(), dev)
        if requested is not None and requested not in ("auto", name):
            warnings.warn(f"rt.init(backend={requested!r}) has no effect: the script initialised "
                          f"torch.distributed itself and ringtrain uses that group ({name}); pass the "
                          "backend to init_process_group() instead", stacklevel=5)
        self._group = weakref.ref(c10d._get_default_group())
        world = World(env=env, backend=name, device=dev, settings=cfg, owns_group=False)
        log.info("joined the existing %s group of %d (device %s)", name, env.size, dev)
        return world, store

    def _group_gone(self) -> bool:
        """Whether the group this world is on is no longer the default group (the script
        destroyed it, and maybe made another)."""
        if self._group is None:
            return False
        joined = self._group()
        return joined is None or not dist.is_initialized() or joined is not c10d._get_default_group()

    def _on_own_group(self, w: World) -> bool:
        """Whether ``w`` is on a group join() made that is still the default group (not
        one the script made itself, nor one it made after destroying ours)."""
        return w.owns_group and dist.is_initialized() and not self._group_gone()

    def _forget_world(self) -> None:
        self.world = self.store = None
        self._group = None
        self.rendezvous.left_joined()

    @staticmethod
    def _acknowledge(env: LaunchEnv) -> None:
        """Tell ringrun this process has joined world ``env.version`` (a resizable job)."""
        try:
            assignment.write_ack(env.elastic_file, env.version)
        except OSError as exc:  # ringrun then never sees the world form: it does not grow it
            log.warning("cannot write %s: %s", assignment.ack_path(env.elastic_file), exc.strerror)

    def connect_store(self) -> dist.Store | None:
        """A new connection to this job's store, under the current prefix (None in a
        1-process world without a store)."""
        w = self.current()
        return self.rendezvous.connect(w.env, w.settings)

    # -- leaving ---------------------------------------------------------------------------

    def leave(self) -> None:
        """Leave the job; safe to call twice or without :meth:`join`."""
        w = self.world
        if w is None:
            return
        if self.broken is not None:
            # A peer is gone mid-exchange: tearing the groups down would wait for it.
            self._forget_world()
            return
        for fn in list(self._hooks):
            fn()
        inflight.drain()
        # A group the script made itself is the script's to end, and so is one it made
        # after destroying ours.
        if self._on_own_group(w):
            dist.destroy_process_group()
        if w.owns_group and w.env.size > 1 and self.store is not None:
            wait_for_everyone_to_leave(self.store, w.env, w.settings)
        self._forget_world()

    def abandon(self) -> None:
        """Leave the world without waiting for its peers (a resizable job re-forming after a
        loss, or growing). Call :meth:`sever` on the world's addresses first: then no thread
        of the old groups waits on a peer, and they are destroyed at once. Clears the broken
        mark, so the next :meth:`join` (after :meth:`assign`) starts clean.

        An NCCL world's groups are aborted first, before the layers' hooks run: closing
        connections does not end an NCCL kernel spinning on a peer that vanished (NVLink,
        shared memory and InfiniBand are no sockets of ours), and ``destroy_process_group``
        is torch's normal exit: ``ProcessGroupNCCL.shutdown()`` waits for every NCCL kernel
        to finish, so it hung here (and a hook's ``destroy_process_group`` of an exchange
        group did too) until the watchdog's timeout. ``_abort_process_group`` is torch's
        bail-out for hangs and failures: every communicator is aborted at once (NCCL's
        group abort, so two hung communicators cannot block each other's abort), which
        ends their kernels and frees their GPU memory before the next world makes its own.
        """
        w = self.world
        if w is not None:
            if self._on_own_group(w) and w.backend == "nccl":
                _abort_all_groups()
            self._run_hooks_leniently("abandon")
            if self._on_own_group(w):
                try:
                    dist.destroy_process_group()
                except Exception as exc:  # noqa: BLE001 - the world is gone whatever it raised
                    log.debug("abandon: destroying the groups failed (%s)", exc)
        self._forget_world()
        self.broken = None

    def assign(self, overlay: Mapping[str, str]) -> None:
        """Make the next :meth:`join` join the world ``overlay`` describes: launch variables
        laid over the process's environment (a resizable job's next world, as ringrun wrote
        it, see :mod:`ringtrain.assignment`). Call it while not joined."""
        if self.world is not None:
            raise ConfigError("runtime.assign() while initialised: leave the world first "
                              "(shutdown() or abandon())")
        self._assigned = dict(overlay)
        if self._gloo_iface_ours:  # chosen for the last world's rank 0: choose again for this one
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
            self._gloo_iface_ours = False

    def sever(self, addresses: Collection[str]) -> int:
        """Shut down this process's connections to ``addresses`` (a resizable job leaving a
        world), so nothing of the world waits on a peer that vanished. Spared: the
        connections the script had before it joined, and those of this process's own store
        server (other worlds' ranks use it). Returns how many were shut down."""
        if not addresses:
            return 0
        # Connections other processes made to this one's server stay: a later world's ranks
        # may be connecting to it while this runs (so the port is checked per connection,
        # not from a list taken earlier).
        own = self.rendezvous.own_port
        keep = () if own is None else (own,)
        try:
            return sever_mod.sever(addresses, keep_local_ports=keep, spare=self.rendezvous.spared)
        finally:
            # Waits that no connection ends (an operation waiting for a rank to submit it)
            # are ended by the layers that own them.
            for fn in list(self._sever_hooks):
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - leaving the world either way
                    log.debug("sever hook %r failed: %s", fn, exc)

    def add_sever_hook(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` after :meth:`sever` (a layer whose waits no connection ends, such as
        the Horovod coordinator's, fails them there)."""
        if fn not in self._sever_hooks:
            self._sever_hooks.append(fn)

    # -- a world that broke under the process ------------------------------------------------

    def mark_broken(self, reason: str) -> None:
        """A collective failed because a peer stopped or vanished mid-exchange.

        The process groups cannot be torn down cleanly any more: Gloo's destructor joins a
        thread that is blocked receiving from that peer, for up to the init timeout (300 s),
        so a rank that raised a StallError would linger instead of ending the job. From now
        on :meth:`leave` skips the teardown, and at exit the process leaves at once (after
        the other exit handlers ran: timeline and doctor reports are still written) with
        status 1, so the launcher stops the job and can restart it.

        Outside a world (a resizable job between :meth:`abandon` and the next
        :meth:`join`, where a late failure of the old world's operations can still be
        reported) there are no groups to spare: nothing is marked, or the next world would
        end with status 1.
        """
        if self.world is None:
            log.debug("not in a world: not marked broken (%s)", reason)
            return
        if self.broken is None:
            self.broken = reason
            log.debug("process groups marked broken: %s", reason)

    def add_shutdown_hook(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in :meth:`leave` before the process group goes (layers below the
        runtime, such as the exchange strategies, release their groups and threads here)."""
        if fn not in self._hooks:
            self._hooks.append(fn)

    def _run_hooks_leniently(self, when: str) -> None:
        """The shutdown hooks, for a world that is over either way: a failing one is logged."""
        for fn in list(self._hooks):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the world is gone whatever it raised
                log.debug("%s: shutdown hook failed (%s)", when, exc)

    def _exit_wait_s(self) -> float:
        """How long exit waits for ringtrain's threads: as long as an exchange may wait
        (rank 0's store answers from a thread of its own even while its script is busy, so
        only a frozen or vanished rank 0 makes this wait)."""
        stall = self.world.settings.stall_timeout if self.world is not None else 0.0
        return max(5.0, stall)

    def _exit_guard(self) -> None:
        if self.broken is None:
            if self.world is not None:
                # Left without shutdown(): release what the layers above hold (exchange
                # groups and their threads, stall reporting) now, while their threads can
                # still be joined. The process group itself is left as torch leaves it.
                self._run_hooks_leniently("exit")
            # The backend's threads must let go of our tensors while the interpreter can
            # still take their decrefs (see ringtrain.inflight).
            inflight.drain()
            # No thread of ours may be inside a backend call once finalization starts
            # (see ringtrain.inflight): one that does not finish in time makes this a
            # clean exit with status 1 rather than an abort.
            wait_s = self._exit_wait_s()
            stuck = inflight.settle(wait_s)
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


def parse_group(env: LaunchEnv, store: dist.Store, rank: int, size: int, timeout_s: float) -> LaunchEnv:
    """This process's place in a group the script started without a launcher: every rank
    publishes its host name in the group's store and reads the others' (every rank of
    the group calls ``rt.init()``, as it called ``init_process_group()``)."""
    store.set(f"host/{rank}", socket.gethostname())
    keys = [f"host/{r}" for r in range(size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise LaunchEnvError(
            f"rank(s) {rank_list(missing)} of the script's process group did not call rt.init() "
            f"within {timeout_s:g} s; call it on every rank (RINGTRAIN_INIT_TIMEOUT sets the wait)"
        ) from None
    hosts = [store.get(k).decode() for k in keys]
    tcp = tcp_store_of(store)
    return from_group(env, rank, size, hosts, (tcp.host, tcp.port) if tcp is not None else None)


def _abort_all_groups() -> None:
    """Abort every process group of this process without waiting for any peer (see
    :meth:`Membership.abandon`); a failure is logged and the groups are then destroyed."""
    try:
        c10d._abort_process_group()
    except Exception as exc:  # noqa: BLE001 - destroy_process_group() is tried next
        log.debug("abandon: aborting the groups failed (%s)", exc)


#: The process's one membership (a process is in at most one world at a time).
MEMBERSHIP = Membership()


def _default_group_ref() -> weakref.ref[Any] | None:
    """A weak reference to the default group, None where there is none to watch (a test
    that stands in for init_process_group)."""
    try:
        return weakref.ref(c10d._get_default_group())
    except (ValueError, RuntimeError):
        return None
