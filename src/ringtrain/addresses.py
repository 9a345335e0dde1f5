"""Addresses and interfaces of this host: which address rank 0 listens on, which
interface Gloo uses, whether an address is this host's loopback.

Shared by the launcher (rank 0's address, the host agent's report) and the workers
(``rt.init()`` picks Gloo's interface), so it is a leaf of the standard library only.
Nothing here sends a packet: the route to an address is found with a connected UDP
socket, which only asks the kernel's routing table.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

__all__ = [
    "address_of_interface",
    "interface_addresses",
    "interface_of_address",
    "interface_towards",
    "is_loopback",
    "resolve",
    "source_address_for",
]

_SIOCGIFADDR = 0x8915


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (an address or ``localhost``) is this host's loopback: a one-host
    job stays there, and no other host can reach a rendezvous bound to it."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr in ("localhost", "localhost.localdomain")


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # down, or no IPv4 address
    return socket.inet_ntoa(packed[20:24])


def interface_addresses() -> dict[str, str]:
    """``{interface: IPv4 address}`` for every interface that has one (first address only)."""
    found = {}
    for _, name in socket.if_nameindex():
        addr = _ipv4_of(name)
        if addr is not None:
            found[name] = addr
    return found


def address_of_interface(name: str) -> str | None:
    """The IPv4 address of interface ``name``, or None when it has none or does not exist."""
    return interface_addresses().get(name)


def interface_of_address(addr: str) -> str | None:
    """The interface that owns ``addr`` (e.g. ``eth0`` for this host's 10.0.0.5)."""
    for name, own in interface_addresses().items():
        if own == addr:
            return name
    return None


def source_address_for(dest: str) -> str | None:
    """The local address the kernel would use to reach ``dest`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in dest else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))  # port 9 (discard); a UDP connect only picks a route
            return str(s.getsockname()[0])
    except OSError:
        return None


def resolve(host: str) -> str | None:
    """The first IPv4 address of ``host`` (an address is returned as is), or None."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    return str(infos[0][4][0]) if infos else None


def interface_towards(addr: str) -> str | None:
    """The interface this host would use to reach ``addr``, a name or an address (None
    when it cannot be resolved or routed)."""
    dest = resolve(addr)
    source = source_address_for(dest) if dest else None
    return interface_of_address(source) if source else None
