"""The job's store, as this process reaches it: one connection kept for the process's
life, a key prefix per world, the check-in before a process group forms and the
check-out after it is gone.

Rank 0 of a fixed-size job hosts the store server (on the socket ringrun reserved, or
one bound here on ``MASTER_ADDR`` only); every other rank connects to it. A process of
a resizable job (``ringrun --min-np/--max-np``) hosts a server of its own from its start,
on the port ringrun reserved for it, since any survivor may become rank 0 of a later
world, and connects anew to each world's rank 0. ``rt.init() -> rt.shutdown() ->
rt.init()`` (Horovod's suites do it every test) reuses the connection and, on rank 0, the
server, so no rank can reach a store that is going away; each world and each restart
attempt rendezvouses under its own prefix, so no key of an earlier one is ever read.

Rank 0's server is torch's multi-tenant one, as torch's env:// rendezvous makes: a script's
own ``init_process_group()`` on ``MASTER_PORT`` after ``rt.shutdown()`` shares it instead
of failing to bind the port, and ``rt.init()`` shares a server the script's destroyed group
left listening there, as every rank of a torchrun job shares the agent's store. Two
groups of the script's one after the other on that shared server (``init_process_group()``,
``destroy_process_group()``, ``init_process_group()``) meet the first one's keys, as under
torchrun.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from typing import Any, cast

import torch.distributed as dist

from ringtrain import sever, sockets
from ringtrain.env import LaunchEnv
from ringtrain.errors import LaunchEnvError, first_line, rank_list
from ringtrain.settings import Settings
from ringtrain.signing import Signer

__all__ = ["Rendezvous", "await_everyone", "tcp_store_of", "wait_for_everyone_to_leave"]

log = logging.getLogger("ringtrain")


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


class Rendezvous:
    """This process's connections to its job's store (see the module docstring)."""

    def __init__(self) -> None:
        #: (what identifies rank 0's store, the connection to it)
        self._base: tuple[tuple[object, ...], dist.Store] | None = None
        #: How many times this process joined through the same connection.
        self.generation = 0
        #: The key prefix of the current world.
        self.prefix = ""
        #: A resizable job: this process's own store server, its port, and the sockets it
        #: had before (never severed: the script's own connections and the server's).
        self._own_server: dist.TCPStore | None = None
        self.own_port: int | None = None
        self.spared: frozenset[int] = frozenset()
        #: The store of the script's own group while joined to it, and how many times
        #: this process joined such a group (each join has a prefix of its own).
        self._joined_base: dist.Store | None = None
        self._joined_count = 0

    def open(self, env: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
        """The store of the world ``env`` describes, under that world's prefix."""
        self._joined_base = None
        resizable = bool(env.elastic_file)
        if resizable:
            self._serve_own(env, timeout)
        elif env.size == 1 and env.master_port is None:
            return dist.HashStore()
        assert env.master_port is not None  # guaranteed by LaunchEnv validation
        key: tuple[object, ...] = (
            ("elastic", env.master_addr, env.master_port, env.version, env.run_id, env.attempt) if resizable
            else (env.master_addr, env.master_port, env.rank, env.size, env.run_id, env.attempt))
        if self._base is None or self._base[0] != key:
            self._base = (key, self._connect(env, timeout, serve=not resizable and env.rank == 0
                                             and not env.agent_store))
            self.generation = 0
        else:
            self.generation += 1
        world = f"v{env.version}/" if resizable else ""
        self.prefix = f"ringtrain/{env.run_id}/{env.attempt}/{world}{self.generation}/"
        return dist.PrefixStore(self.prefix, self._base[1])

    def joined_existing(self, env: LaunchEnv) -> dist.Store:
        """The store of a process group the script started itself, under ringtrain's prefix.

        A prefix per join: a later ``rt.init()`` on the same group (after
        ``rt.shutdown()``) or on the script's next one must not read the keys of an
        earlier world (its exchange group connected to the old Gloo addresses, "Connection
        refused"). A TCP store is reached through a connection of ringtrain's own: holding
        the script's store object kept rank 0's server listening after the script's
        ``destroy_process_group()``, so its next ``init_process_group()`` could not bind
        ``MASTER_PORT`` (or its ranks met in the old store).
        """
        from torch.distributed.distributed_c10d import _get_default_store

        base = _own_connection(_get_default_store())
        self._joined_base = base
        self._joined_count += 1
        self.prefix = f"ringtrain/{env.run_id}/{env.attempt}/joined/{self._joined_count}/"
        return dist.PrefixStore(self.prefix, base)

    def left_joined(self) -> None:
        """The world on the script's group is over: let go of its store (a file store the
        script's group no longer uses is then removed as without ringtrain)."""
        self._joined_base = None

    def connect(self, env: LaunchEnv, settings: Settings) -> dist.Store | None:
        """A new connection under the current prefix (None in a 1-process world without a
        store). For threads that block in ``store.wait``: one client connection
        serialises every call made on it."""
        if self._joined_base is not None:  # the script's group: its store, wherever it is
            if env.size == 1:
                return None
            return dist.PrefixStore(self.prefix, _own_connection(self._joined_base))
        if env.master_port is None or env.size == 1:
            return None
        timeout = datetime.timedelta(seconds=settings.init_timeout)
        client = dist.TCPStore(env.master_addr, env.master_port, env.size, False, timeout=timeout)
        return dist.PrefixStore(self.prefix, client)

    def _connect(self, env: LaunchEnv, timeout: datetime.timedelta, serve: bool) -> dist.Store:
        """Rank 0's store: served here (``serve``), else a client connection to it."""
        assert env.master_port is not None
        if serve:
            # multi_tenant: torch's env:// and tcp:// rendezvous share a server this process
            # already runs on their port (as every rank of a torchrun job is a client of the
            # agent's store), so the script's own init_process_group() after rt.shutdown()
            # finds MASTER_PORT served, not taken (EADDRINUSE).
            try:
                listen_fd = _store_listener(env)
            except LaunchEnvError:
                if not _listens_here(env.master_port):
                    raise
                return _share_scripts_server(env, timeout)
            return dist.TCPStore(env.master_addr, env.master_port, env.size, True, timeout=timeout,
                                 wait_for_workers=False, multi_tenant=True, master_listen_fd=listen_fd)
        try:
            return dist.TCPStore(env.master_addr, env.master_port, env.size, False, timeout=timeout)
        except RuntimeError as exc:
            if env.elastic_file:
                raise LaunchEnvError(
                    f"rank {env.rank} cannot reach rank 0's rendezvous of world {env.version} at "
                    f"{env.master_addr}:{env.master_port} ({first_line(exc)})") from None
            raise LaunchEnvError(
                f"rank {env.rank} cannot reach rank 0's rendezvous at {env.master_addr}:"
                f"{env.master_port} within {timeout.total_seconds():g} s ({first_line(exc)}); check "
                "MASTER_ADDR/MASTER_PORT and that rank 0 started (RINGTRAIN_INIT_TIMEOUT sets the wait)"
            ) from None

    def _serve_own(self, env: LaunchEnv, timeout: datetime.timedelta) -> None:
        """Start this process's own store server on the port ringrun reserved (once)."""
        if self._own_server is not None or env.store_fd is None:
            return
        before = set(sever.socket_inodes())
        reserved = socket.socket(fileno=env.store_fd)
        addr, port = reserved.getsockname()[:2]
        reserved.detach()
        try:
            self._own_server = dist.TCPStore(str(addr), int(port), None, True, timeout=timeout,
                                             wait_for_workers=False, multi_tenant=True,
                                             master_listen_fd=sockets.listen_on(env.store_fd))
        except (OSError, RuntimeError) as exc:
            raise LaunchEnvError(f"cannot serve this worker's rendezvous on {addr}:{port} ({exc}); "
                                 "ringrun reserved it, so another process took it") from None
        self.own_port = int(port)
        # Never severed (see Membership.sever): what existed before (the script's own
        # connections) and the server's connection to itself, made just now.
        self.spared = frozenset(before | set(sever.socket_inodes()))


def _listens_here(port: int) -> bool:
    """Whether this process has a socket listening on ``port`` (``/proc/self/net``)."""
    return any(parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port
               for parts, _ in sever.tcp_rows())


def _share_scripts_server(env: LaunchEnv, timeout: datetime.timedelta) -> dist.Store:
    """Rank 0's store when this process already serves ``MASTER_PORT``: the server of a
    group the script made itself (``init_process_group()``), destroyed while an object of
    it (a DDP module) still holds its store, so the server still listens. torchrun's
    ranks are all clients of its agent's store, so this works there: share that server
    (torch's multi-tenant store), which every other rank reaches at the same address.
    Only a server torch shares (its env:// and tcp:// rendezvous make one) can be."""
    assert env.master_port is not None
    try:
        return dist.TCPStore(env.master_addr, env.master_port, env.size, True, timeout=timeout,
                             wait_for_workers=False, multi_tenant=True)
    except RuntimeError as exc:
        raise LaunchEnvError(
            f"rank 0 cannot serve the rendezvous on {env.master_addr}:{env.master_port}: a store "
            f"server of this script's own still listens there ({first_line(exc)}); drop what holds "
            "its destroyed process group (a DDP module), or create that store with "
            "multi_tenant=True") from None


def tcp_store_of(store: dist.Store) -> dist.TCPStore | None:
    """The TCP store under ``store``'s prefixes (None: a file or in-memory store)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def _own_connection(store: dist.Store) -> dist.Store:
    """A new client connection to a TCP store, under the same prefixes (``clone()``, which
    torch's type stubs lack); a file or in-memory store itself."""
    if tcp_store_of(store) is None:
        return store
    clone: dist.Store = cast(Any, store).clone()
    return clone


def await_everyone(store: dist.Store, env: LaunchEnv, timeout_s: float) -> None:
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


def wait_for_everyone_to_leave(store: dist.Store, env: LaunchEnv, settings: Settings) -> None:
    """Rank 0 hosts the rendezvous store: it must outlive every rank's process group.

    If rank 0 exits while another rank still tears its Gloo group down, that rank's
    connection to the store breaks under a C++ thread and the process aborts
    ("terminate called without an active exception", seen 1 run in 6 of a 4-rank job).
    So every rank reports that it has left, and rank 0 waits (bounded) for all of them.
    """
    seal = Signer(env.secret)
    try:
        key = f"shutdown/left/{env.rank}"
        store.set(key, seal.seal(key, "1"))
        if env.rank != 0:
            return
        deadline = time.monotonic() + min(30.0, settings.init_timeout)
        waiting = set(range(1, env.size))
        while waiting and time.monotonic() < deadline:
            for r in list(waiting):
                k = f"shutdown/left/{r}"
                if store.check([k]) and seal.open(k, store.get(k)) == "1":
                    waiting.discard(r)
            if waiting:
                time.sleep(0.01)
    except (RuntimeError, OSError) as exc:  # a rank already gone: nothing left to protect
        log.debug("shutdown: store no longer reachable (%s)", exc)
