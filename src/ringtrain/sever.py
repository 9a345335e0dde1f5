"""Close this process's TCP connections to given hosts (standard library only, Linux).

A worker of a resizable job leaves a world whose peers may be gone (ringrun names the
hosts in the next world's assignment, :mod:`ringtrain.assignment`). A Gloo operation, or a store
wait, blocked on a peer that vanished without closing its connections (a host that lost
power or its network) waits for its timeout (minutes) and cannot be interrupted from
Python. ``shutdown(2)`` on our end of those connections can: the blocked reader sees the
connection end at once and the operation fails with an error the caller handles. The
process's connections are found in ``/proc/self/net/tcp{,6}`` and matched to its file
descriptors through ``/proc/self/fd``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Collection, Iterator
from dataclasses import dataclass

__all__ = ["Connection", "connections", "sever", "socket_inodes", "tcp_rows"]

_ESTABLISHED_OR_CLOSING = {"01", "02", "03", "04", "05", "06", "08", "09", "0B"}  # not LISTEN (0A)


@dataclass(frozen=True)
class Connection:
    fd: int
    inode: int
    local_port: int
    remote_addr: str
    remote_port: int


def socket_inodes() -> dict[int, int]:
    """``{socket inode: fd}`` of this process."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])  # /proc prints host byte order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    addr = ipaddress.IPv6Address(words)
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def tcp_rows() -> Iterator[tuple[list[str], int]]:
    """The rows of ``/proc/self/net/tcp{,6}`` that are this process's sockets (the tables
    are the network namespace's), split into fields, with the socket's fd."""
    fds = socket_inodes()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) >= 10 and int(parts[9]) in fds:
                yield parts, fds[int(parts[9])]


def connections() -> list[Connection]:
    """This process's TCP connections (listening sockets excluded)."""
    found = []
    for parts, fd in tcp_rows():
        if parts[3] in _ESTABLISHED_OR_CLOSING:
            inode = int(parts[9])
            local_port = int(parts[1].rsplit(":", 1)[1], 16)
            remote_hex, remote_port = parts[2].rsplit(":", 1)
            found.append(Connection(fd, inode, local_port, _address(remote_hex), int(remote_port, 16)))
    return found


def sever(addresses: Collection[str], keep_local_ports: Collection[int] = (),
          spare: Collection[int] = ()) -> int:
    """Shut down every connection to one of ``addresses``; the number shut down.

    ``keep_local_ports``: connections whose local end has one of these ports stay (this
    process's own store server: the connections it accepted, which a later world's ranks
    may be opening while this runs; decided per connection from the same listing, so one
    that arrives meanwhile is never mistaken for the old world's). ``spare``: socket
    inodes that stay (connections the script had before it joined the job).
    """
    wanted = set(addresses)
    keep = set(keep_local_ports)
    count = 0
    for c in connections():
        if c.remote_addr not in wanted or c.inode in spare or c.local_port in keep:
            continue
        if not _still_holds(c):
            continue  # closed since the listing, its number maybe reused: not ours to touch
        try:
            sock = socket.socket(fileno=c.fd)
        except OSError:
            continue  # closed meanwhile
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass  # already closed by the peer
        finally:
            sock.detach()  # the descriptor stays its owner's (Gloo, the store) to close
    return count


def _still_holds(c: Connection) -> bool:
    """Whether descriptor ``c.fd`` is still the socket ``c.inode`` of the listing."""
    try:
        return os.readlink(f"/proc/self/fd/{c.fd}") == f"socket:[{c.inode}]"
    except OSError:
        return False
