"""Which TCP addresses the processes of a test job listen on (from /proc, any namespace)."""

from __future__ import annotations

import ipaddress
import socket
import struct
from pathlib import Path

from hosts.harness import processes_with

__all__ = ["listening_addresses"]

_LISTEN = "0A"


def _decode(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        addr = socket.inet_ntoa(struct.pack("<I", int(host, 16)))
    else:  # IPv6: four little-endian 32-bit words
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        addr = str(ipaddress.IPv6Address(b"".join(words)))
    return addr, int(port, 16)


def listening_addresses(marker: str) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket owned by a process of the job."""
    found: set[tuple[str, int]] = set()
    for pid in processes_with(marker):
        inodes = set()
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = str(fd.readlink()) if fd.is_symlink() else ""
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
        for table in ("tcp", "tcp6"):  # the process's own network namespace's tables
            try:
                rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                if cols[3] == _LISTEN and cols[9] in inodes:
                    found.add(_decode(cols[1]))
    return found
