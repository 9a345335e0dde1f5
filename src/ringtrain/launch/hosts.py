"""Host lists: ``-H a:4,b:4``, hostfiles, and where each rank runs (pure functions)."""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ringtrain import addresses
from ringtrain.errors import ConfigError

__all__ = ["Host", "Placement", "TooFewSlots", "is_local_host", "parse_hostfile", "parse_hosts",
           "place_ranks"]

_HOST = re.compile(r"^[A-Za-z0-9_.\-:]+$")


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
    if ":" in name:
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            raise ConfigError(f"bad host name {name!r} in {where}: not an IPv6 address; "
                              "use a name or address like server1") from None


def _split_entry(entry: str, where: str) -> tuple[str, str | None]:
    """``host``, ``host:N``, ``[v6addr]`` or ``[v6addr]:N`` -> (name, slots or None).

    An IPv6 address goes in brackets: ``fe80::1:2`` could be that address, or ``fe80::1``
    with 2 slots. The brackets are dropped from the name (ssh takes the bare address).
    """
    if entry.startswith("["):
        close = entry.find("]")
        rest = entry[close + 1:] if close > 0 else ""
        if close < 0 or (rest and not rest.startswith(":")):
            raise ConfigError(f"bad host {entry!r} in {where}; write an IPv6 address as [addr] or [addr]:N")
        name = entry[1:close]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            raise ConfigError(f"bad host {entry!r} in {where}: {name!r} is not an IPv6 address; "
                              "brackets are for IPv6 addresses only, e.g. [fe80::1]:4") from None
        return name, rest[1:] if rest else None
    name, sep, slots = entry.rpartition(":")
    if not sep:
        return entry, None
    if ":" in name:
        raise ConfigError(f"bad host {entry!r} in {where}; write an IPv6 address in brackets, "
                          "e.g. [::1] or [::1]:4")
    return name, slots


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
        name, given = _split_entry(entry, where)
        slots = "1" if given is None else given
        _check_host(name, where)
        if not (slots.isascii() and slots.isdigit()) or int(slots) < 1:
            raise ConfigError(
                f"bad slot count {slots!r} for host {name!r} in {where}; use host:N with N >= 1"
            )
        hosts.append(Host(name, int(slots)))
    return _check_unique(hosts, where)


def parse_hostfile(path: str | Path) -> list[Host]:
    """Parse lines like ``server1 slots=4``; ``#`` comments and blank lines are ignored."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read hostfile {p}: {exc.strerror}; check the path") from None
    except UnicodeDecodeError:
        raise ConfigError(f"hostfile {p} is not a text file (not UTF-8); give a file of lines "
                          "'host slots=N'") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {p} line {number}"
        parts = line.split()
        bad = ConfigError(f"cannot parse {raw.strip()!r} in {where}; write 'host slots=N' with N >= 1")
        name, given = parts[0], None
        if name.startswith("[") or name.count(":") == 1:  # host:N, [v6addr], [v6addr]:N
            name, given = _split_entry(name, where)
        # (a bare IPv6 address, with more than one ':', is a name without slots)
        keys: set[str] = set()
        for extra in parts[1:]:
            key, sep, value = extra.partition("=")
            if key not in ("slots", "max_slots") or not sep or not (value.isascii() and value.isdigit()) \
                    or int(value) < 1 or key in keys:
                raise bad
            keys.add(key)
            if key == "slots":
                if given is not None:  # host:N slots=M: which one?
                    raise bad
                given = value
        if given is not None and not (given.isascii() and given.isdigit() and int(given) >= 1):
            raise bad
        _check_host(name, where)
        hosts.append(Host(name, 1 if given is None else int(given)))
    if not hosts:
        raise ConfigError(f"hostfile {p} lists no hosts; add lines like 'server1 slots=4'")
    return _check_unique(hosts, f"hostfile {p}")


class TooFewSlots(ConfigError):
    """More ranks than slots, without ``--oversubscribe``. Its own class so that
    ``horovodrun``, whose command line (as Horovod's) has no ``--oversubscribe``, can word
    the advice without it (:attr:`np`, :attr:`total` and :attr:`listed` say what was
    asked and what there is)."""

    def __init__(self, message: str, np: int = 0, total: int = 0, listed: str = "") -> None:
        super().__init__(message)
        self.np, self.total, self.listed = np, total, listed


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
    if total < 1:
        raise ConfigError("no slots to place ranks on; give every host 1 or more slots")
    capacity = [h.slots for h in hosts]
    if np > total:
        if not oversubscribe:
            listed = slots_note or ",".join(f"{h.name}:{h.slots}" for h in hosts)
            raise TooFewSlots(
                f"-np {np} is more than the {total} slots of {listed}; lower -np, add slots, "
                "or pass --oversubscribe to run more ranks than slots", np, total, listed
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
