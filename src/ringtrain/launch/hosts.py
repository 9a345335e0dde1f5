"""Host lists: ``-H a:4,b:4``, hostfiles, and where each rank runs (pure functions)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ringtrain import addresses
from ringtrain.errors import ConfigError

__all__ = ["Host", "Placement", "is_local_host", "parse_hostfile", "parse_hosts", "place_ranks"]

_HOST = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class Placement:
    """Where one rank runs and its place among the ranks of its host."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def is_local_host(name: str) -> bool:
    """Loopback names and this machine's own host name run without ssh."""
    return addresses.is_loopback(name) or name == socket.gethostname()


def _check_host(name: str, where: str) -> None:
    if not name or not _HOST.match(name):
        raise ConfigError(f"bad host name {name!r} in {where}; use a name or address like server1")


def _check_unique(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise ConfigError(
                f"host {h.name!r} appears twice in {where}; list each host once with its total slots"
            )
        seen.add(h.name)
    return hosts


def parse_hosts(spec: str) -> list[Host]:
    """Parse ``host1:4,host2:4`` (a host without ``:slots`` has one slot)."""
    where = f"-H {spec!r}"
    hosts = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            raise ConfigError(f"empty entry in {where}; write hosts as host1:4,host2:4")
        name, sep, slots = entry.rpartition(":")
        if not sep or "]" in slots:  # no ':', or an IPv6 literal without slots
            name, slots = entry, "1"
        _check_host(name, where)
        if not slots.isdigit() or int(slots) < 1:
            raise ConfigError(
                f"bad slot count {slots!r} for host {name!r} in {where}; use host:N with N >= 1"
            )
        hosts.append(Host(name, int(slots)))
    return _check_unique(hosts, where)


def parse_hostfile(path: str | Path) -> list[Host]:
    """Parse lines like ``server1 slots=4``; ``#`` comments and blank lines are ignored."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read hostfile {p}: {exc.strerror}; check the path") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {p} line {number}"
        parts = line.split()
        name, slots = parts[0], 1
        for extra in parts[1:]:
            key, sep, value = extra.partition("=")
            if key not in ("slots", "max_slots") or not sep or not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"cannot parse {raw.strip()!r} in {where}; write 'host slots=N' with N >= 1"
                )
            if key == "slots":
                slots = int(value)
        if ":" in name and name.count(":") == 1 and name.split(":")[1].isdigit():
            name, slots = name.split(":")[0], int(name.split(":")[1])
        _check_host(name, where)
        hosts.append(Host(name, slots))
    if not hosts:
        raise ConfigError(f"hostfile {p} lists no hosts; add lines like 'server1 slots=4'")
    return _check_unique(hosts, f"hostfile {p}")


def place_ranks(hosts: list[Host], np: int, oversubscribe: bool = False,
                slots_note: str = "") -> list[Placement]:
    """Fill hosts in order (host 1's slots first), as horovodrun and mpirun do by default.

    More ranks than slots is refused unless ``oversubscribe``; then each host takes a
    share of the ranks in proportion to its slots (rounded up, hosts in order), so
    ``-np 5 -H a:2,b:2`` puts 3 ranks on a and 2 on b. ``slots_note`` says where the
    slots came from, for the message (e.g. "this host's 2 CPU cores").
    """
    total = sum(h.slots for h in hosts)
    if np < 1:
        raise ConfigError(f"-np must be >= 1, got {np}")
    capacity = [h.slots for h in hosts]
    if np > total:
        if not oversubscribe:
            listed = slots_note or ",".join(f"{h.name}:{h.slots}" for h in hosts)
            raise ConfigError(
                f"-np {np} is more than the {total} slots of {listed}; lower -np, add slots, "
                "or pass --oversubscribe to run more ranks than slots"
            )
        capacity = [-(-np * h.slots // total) for h in hosts]
    counts: list[tuple[str, int]] = []
    left = np
    for h, cap in zip(hosts, capacity, strict=False):
        if left == 0:
            break
        take = min(cap, left)
        counts.append((h.name, take))
        left -= take
    placements = []
    rank = 0
    for cross_rank, (name, count) in enumerate(counts):
        for local_rank in range(count):
            placements.append(Placement(rank, name, local_rank, count, cross_rank, len(counts)))
            rank += 1
    return placements
