"""The one place that binds rendezvous sockets (no torch: the launcher uses it too).

ringrun (or its agent on a remote rank 0's host) *reserves* rank 0's rendezvous port
before any worker starts, so a port in use is reported up front and no other job can
take it meanwhile. A reservation is a socket bound with ``SO_REUSEADDR`` but **not
listening**: Linux lets another ``SO_REUSEADDR`` socket bind the same address as long as
no one listens on it. That matters because rank 0 may be either

- a ringtrain script: ``rt.init()`` turns the inherited reservation into the store's
  listening socket (:func:`listen_on`), so the store listens only on the reserved
  address (loopback for a one-host job) and there is no window in which another process
  could take the port; or
- a script written for torchrun that calls ``torch.distributed.init_process_group()``
  itself: torch's TCPStore binds ``MASTER_PORT`` with ``SO_REUSEADDR`` and succeeds
  beside the idle reservation (a listening socket there made it fail with EADDRINUSE).
"""

from __future__ import annotations

import errno
import socket

from ringtrain.errors import ConfigError

__all__ = ["in_use", "listen_on", "reserve", "reserve_rendezvous"]


def reserve(addr: str, port: int) -> socket.socket:
    """A socket bound to ``addr:port`` (0: a free port), not listening. Raises OSError."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    bind_addr = "" if addr in ("0.0.0.0", "::") else addr
    try:
        sock.bind((bind_addr, port))
    except OSError:
        sock.close()
        raise
    return sock


def listen_on(fd: int) -> int:
    """Start listening on the reserved socket ``fd`` (inherited from ringrun) and return
    the descriptor for torch's ``TCPStore(master_listen_fd=...)``. Raises OSError when
    someone else already listens on that port."""
    sock = socket.socket(fileno=fd)
    try:
        sock.listen(1024)
    finally:
        sock.detach()  # the descriptor stays open, owned by the caller
    return fd


def in_use(exc: OSError) -> bool:
    """Whether a bind or listen failed because the port is taken."""
    return exc.errno == errno.EADDRINUSE


def reserve_rendezvous(addr: str, port: int, host: str | None = None) -> socket.socket:
    """:func:`reserve` rank 0's rendezvous port for a job, or a ConfigError that says what
    to do: on ringrun's own host (``host`` None) or, by its host agent, on ``host``."""
    try:
        return reserve(addr, port)
    except OSError as exc:
        if host is None:
            if port and in_use(exc):
                raise ConfigError(f"--master-port {port} is in use on {addr}; choose another port or "
                                  "omit --master-port to let ringrun pick a free one") from None
            raise ConfigError(f"cannot listen on {addr}:{port} ({exc.strerror}); pass --master-addr "
                              "with an address of this host") from None
        if port and in_use(exc):
            raise ConfigError(f"port {port} on {addr} is in use on host {host}; "
                              "choose another --master-port or omit it") from None
        raise ConfigError(f"cannot listen on {addr}:{port} on host {host} "
                          f"({exc.strerror}); pass --master-addr or --network-interface with an "
                          "address of rank 0's host") from None
