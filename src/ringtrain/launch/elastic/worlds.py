"""A resizable job's successive worlds: who is in the next one, with which rank (pure).

A *worker* is one started process, numbered once for the job's life (its output and
log file carry that number). A *world* is the list of workers that train together, in
rank order. After a loss the survivors keep their order; on a grow the new workers come
after them. Ranks of one host are kept together (local and cross ranks assume it), hosts
in the order they first appear, so rank 0 stays rank 0 while it lives: it holds the
state the others are synced from.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ringtrain.errors import ConfigError
from ringtrain.launch.hosts import Host, Placement

__all__ = ["COOLDOWN_S", "Blacklist", "ElasticConfig", "WorkerOnHost", "next_world", "placements"]

#: Seconds after which a host that failed may be used again although the discovery
#: script never stopped listing it (Horovod's blacklist cooldown; a fixed -H list has none).
COOLDOWN_S = 60.0


@dataclass(frozen=True)
class ElasticConfig:
    """``ringrun --min-np M --max-np N [--host-discovery-script S] [--reset-limit K]``."""

    min_np: int
    max_np: int
    #: The hosts to use when there is no discovery script (``-H``/``--hostfile``).
    hosts: tuple[Host, ...] = ()
    discovery_script: str | None = None
    #: Ranks of the first world (``-np``); default: every slot there is, up to ``max_np``.
    np: int | None = None
    #: End the job after this many changes of size (None: no limit).
    reset_limit: int | None = None
    cooldown: float = COOLDOWN_S
    #: A failed host comes back after a cooldown drawn in [min, max] seconds, doubled at
    #: each failure of the same host (Horovod's ``--blacklist-cooldown-range``); None:
    #: ``cooldown`` (and, with Horovod's rules, never).
    cooldown_range: tuple[float, float] | None = None
    #: Seconds the job waits for hosts when fewer than ``min_np`` ranks are left (0: it
    #: ends at once; Horovod's ``--elastic-timeout``, 600 s by default there).
    elastic_timeout: float = 0.0
    #: Horovod's rules (what ``horovodrun`` asks for): every name is a host, even two
    #: names of this machine; the first world takes every slot there is up to
    #: ``max_np`` once ``np`` are there; a failed rank's host is blacklisted with its
    #: other ranks; Horovod's messages when the job ends.
    like_horovod: bool = False
    #: Slots of a host the discovery script lists without any (``--slots-per-host``).
    slots_per_host: int = 1

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ConfigError(f"--min-np must be >= 1, got {self.min_np}")
        if self.max_np < self.min_np:
            raise ConfigError(f"--max-np {self.max_np} is below --min-np {self.min_np}; "
                              "give --max-np >= --min-np")
        # (Horovod takes any -np: the first world waits for max(-np, --min-np) slots)
        if self.np is not None and not self.like_horovod and not self.min_np <= self.np <= self.max_np:
            raise ConfigError(f"-np {self.np} must be within --min-np {self.min_np} and "
                              f"--max-np {self.max_np}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"--reset-limit must be >= 0, got {self.reset_limit}")
        if self.slots_per_host < 1:
            raise ConfigError(f"--slots-per-host must be >= 1, got {self.slots_per_host}")
        if not 0 <= self.elastic_timeout < math.inf:  # NaN too
            raise ConfigError(f"--elastic-timeout must be >= 0 seconds, got {self.elastic_timeout:g}")
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            if not 0 < low <= high:
                raise ConfigError(f"--blacklist-cooldown-range {low:g} {high:g}: give two numbers of "
                                  "seconds, 0 < MIN <= MAX (e.g. 60 300)")
        if not self.hosts and not self.discovery_script:
            raise ConfigError("a resizable job needs hosts: -H, --hostfile or --host-discovery-script")


@dataclass(frozen=True)
class WorkerOnHost:
    """A worker and the host it runs on (a host's *slots* are how many it may run)."""

    worker: int
    host: str


def _grouped(order: Sequence[WorkerOnHost]) -> list[WorkerOnHost]:
    hosts: dict[str, list[WorkerOnHost]] = {}
    for s in order:
        hosts.setdefault(s.host, []).append(s)
    return [s for group in hosts.values() for s in group]


def next_world(survivors: Sequence[WorkerOnHost], added: Sequence[WorkerOnHost],
               can_be_rank0: Callable[[WorkerOnHost, set[str]], bool] = lambda _s, _hosts: True,
               ) -> list[WorkerOnHost] | None:
    """The next world in rank order, or None when no survivor can be rank 0.

    Rank 0 must be a survivor (the new workers have no state to give) whose rendezvous
    every host of the world can reach: ``can_be_rank0(slot, the world's hosts)``.
    """
    order = _grouped([*survivors, *added])
    hosts = {s.host for s in order}
    for first in survivors:
        if can_be_rank0(first, hosts):
            head = [s for s in order if s.host == first.host]
            head.remove(first)
            rest = [s for s in order if s.host != first.host]
            return [first, *head, *rest]
    return None if survivors else (order or None)


def placements(order: Sequence[WorkerOnHost]) -> list[Placement]:
    """Rank, local rank and cross rank of each worker of a world in rank order."""
    hosts: list[str] = []
    counts: dict[str, int] = {}
    for s in order:
        if s.host not in counts:
            hosts.append(s.host)
            counts[s.host] = 0
        counts[s.host] += 1
    seen: dict[str, int] = {}
    out = []
    for rank, s in enumerate(order):
        local = seen.get(s.host, 0)
        seen[s.host] = local + 1
        out.append(Placement(rank, s.host, local, counts[s.host], hosts.index(s.host), len(hosts)))
    return out


class Blacklist:
    """Hosts not to use again for a while: one whose rank failed, or that was lost.

    A host comes back once the discovery script has stopped listing it and lists it
    again (it was replaced or repaired), or after its cooldown: ``cooldown`` seconds, or
    with ``cooldown_range`` (Horovod's ``--blacklist-cooldown-range MIN MAX``) a time
    that doubles with each failure of that host, ``MIN * 2**(n-1)`` for the n-th, plus
    up to ``MIN`` of jitter so hosts that failed together do not all come back at once,
    kept within ``[MIN, MAX]``. Without either (0 and None) a failed host is never used
    again while it stays listed.
    """

    def __init__(self, cooldown: float = 0.0, cooldown_range: tuple[float, float] | None = None,
                 rng: random.Random | None = None) -> None:
        self.cooldown = cooldown
        self.cooldown_range = cooldown_range
        self._rng = rng or random.Random()
        self._until: dict[str, float] = {}  # host -> when it may come back (inf: never)
        self._failures: dict[str, int] = {}
        self._absent: set[str] = set()

    def add(self, host: str, now: float) -> float:
        """Blacklist ``host``; the seconds until it may come back (inf: never)."""
        n = self._failures[host] = self._failures.get(host, 0) + 1
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            wait = min(high, max(low, low * 2 ** (n - 1) + self._rng.uniform(0.0, low)))
        else:
            wait = self.cooldown if self.cooldown > 0 else float("inf")
        self._until[host] = now + wait
        self._absent.discard(host)
        return wait

    def observe(self, listed: Sequence[str], now: float) -> list[str]:
        """One answer of the discovery script (or a look at a fixed list); the hosts that
        come back now."""
        back = []
        for host in list(self._until):
            if host not in listed:
                self._absent.add(host)
            elif host in self._absent or now >= self._until[host]:
                del self._until[host]
                self._absent.discard(host)
                back.append(host)
        return back

    def blocked(self, host: str) -> bool:
        return host in self._until

    def failures(self, host: str) -> int:
        """How many times ``host`` was blacklisted."""
        return self._failures.get(host, 0)
