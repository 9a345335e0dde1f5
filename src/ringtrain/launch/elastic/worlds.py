"""A resizable job's successive worlds: who is in the next one, with which rank (pure).

A *worker* is one started process, numbered once for the job's life (its output and
log file carry that number). A *world* is the list of workers that train together, in
rank order. After a loss the survivors keep their order; on a grow the new workers come
after them. Ranks of one host are kept together (local and cross ranks assume it), hosts
in the order they first appear, so rank 0 stays rank 0 while it lives: it holds the
state the others are synced from.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ConfigError(f"--min-np must be >= 1, got {self.min_np}")
        if self.max_np < self.min_np:
            raise ConfigError(f"--max-np {self.max_np} is below --min-np {self.min_np}; "
                              "give --max-np >= --min-np")
        if self.np is not None and not self.min_np <= self.np <= self.max_np:
            raise ConfigError(f"-np {self.np} must be within --min-np {self.min_np} and "
                              f"--max-np {self.max_np}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ConfigError(f"--reset-limit must be >= 0, got {self.reset_limit}")
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
               can_be_rank0: Callable[[WorkerOnHost, bool], bool] = lambda _s, _multi: True,
               ) -> list[WorkerOnHost] | None:
    """The next world in rank order, or None when no survivor can be rank 0.

    Rank 0 must be a survivor (the new workers have no state to give) whose rendezvous
    the world's hosts can reach: ``can_be_rank0(slot, multi_host)``.
    """
    order = _grouped([*survivors, *added])
    multi = len({s.host for s in order}) > 1
    for first in survivors:
        if can_be_rank0(first, multi):
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
    again (it was replaced or repaired), or after ``cooldown`` seconds (Horovod's
    blacklist cooldown). A fixed host list never stops listing a host, and without a
    cooldown (0) a failed host is never used again.
    """

    def __init__(self, cooldown: float = 0.0) -> None:
        self.cooldown = cooldown
        self._since: dict[str, float] = {}
        self._absent: set[str] = set()

    def add(self, host: str, now: float) -> None:
        self._since[host] = now
        self._absent.discard(host)

    def observe(self, listed: Sequence[str], now: float) -> None:
        """One answer of the discovery script."""
        for host in list(self._since):
            if host not in listed:
                self._absent.add(host)
            elif host in self._absent or (self.cooldown and now - self._since[host] >= self.cooldown):
                del self._since[host]
                self._absent.discard(host)

    def blocked(self, host: str) -> bool:
        return host in self._since
