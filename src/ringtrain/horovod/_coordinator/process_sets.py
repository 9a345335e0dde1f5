"""Process sets: named subsets of the ranks that run collectives among themselves.

A :class:`ProcessSet` is registered on every rank, in the same order (registration is
collective: ``torch.distributed.new_group`` must be called by every rank of the job),
which gives it the same id everywhere and its own process group. Set 0 is the whole
job. Ranks are global ranks, kept sorted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ringtrain.errors import ConfigError

__all__ = ["ProcessSet"]


class ProcessSet:
    """A subset of the job's ranks (Horovod's ``hvd.ProcessSet``)."""

    def __init__(self, ranks: Iterable[int] | None = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else sorted({int(r) for r in ranks})
        #: Registered id (-1: not registered; 0: the whole job).
        self.process_set_id = -1
        self._group: Any = None  # the data process group (None for the global set: the engine's)
        self._world_rank = -1
        #: The id it had before :meth:`_unbind` (-1: none): a call on a set removed on one
        #: rank only is refused to the others under it (ringtrain.horovod.ops).
        self.removed_id = -1

    # -- Horovod's methods ----------------------------------------------------------------

    def size(self) -> int:
        self._check_registered()
        assert self.ranks is not None
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set; a ValueError when it is not a member, as
        Horovod's (-1 here was taken as an index, ``shards[ps.rank()]`` the last shard)."""
        self._check_registered()
        assert self.ranks is not None
        if self._world_rank not in self.ranks:
            raise ConfigError(f"rank {self._world_rank} is not part of {self!r}: it has no rank in it; "
                              "check ps.included() first")
        return self.ranks.index(self._world_rank)

    def included(self) -> bool:
        self._check_registered()
        assert self.ranks is not None
        return self._world_rank in self.ranks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks or ()))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    # -- used by the coordinator ----------------------------------------------------------

    def _check_registered(self) -> None:
        if self.process_set_id < 0 or self.ranks is None:
            raise ConfigError(
                f"{self!r} is not registered; pass it to hvd.init(process_sets=[...]) or "
                "hvd.add_process_set() on every rank first"
            )

    def _bind(self, set_id: int, ranks: list[int], world_rank: int, group: Any) -> None:
        self.process_set_id = set_id
        self.removed_id = -1
        self.ranks = ranks
        self._world_rank = world_rank
        self._group = group

    def _unbind(self) -> None:
        self.removed_id = self.process_set_id
        self.process_set_id = -1
        self._group = None
