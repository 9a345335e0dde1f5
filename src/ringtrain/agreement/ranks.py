"""The one helper behind every "do the ranks agree?" check (pure).

Each check has every rank's value of something (a collective's header, the fused
exchange's signature, a Horovod request, whether a checkpoint or a layout is usable)
and must answer the same on every rank, so that all raise the same error or none
does. :func:`group_ranks` compares the values: the ranks that hold each distinct one,
in an order every rank computes alike. :func:`settle` exchanges each rank's problem (or
rank 0's verdict) and returns the ranks that found one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["group_ranks", "settle"]

T = TypeVar("T")


def group_ranks(values: Sequence[T] | Mapping[int, T],
                key: Callable[[T], Hashable] | None = None) -> list[list[int]]:
    """The ranks grouped by ``key(value)`` (the value itself without ``key``): each
    group's ranks in ascending order, the groups in the order of their lowest rank. One
    group means every rank agrees."""
    items: list[tuple[int, T]] = sorted(values.items() if isinstance(values, Mapping) else enumerate(values),
                                        key=lambda item: item[0])
    groups: dict[Any, list[int]] = {}
    for rank, value in items:
        groups.setdefault(key(value) if key is not None else value, []).append(rank)
    return sorted(groups.values(), key=lambda ranks: ranks[0])


def settle(mine: str | None, exchange: Callable[[str | None], Sequence[str | None]]) -> dict[int, str]:
    """The ranks that found a problem, by rank, with it: ``exchange`` shares this rank's
    problem (None: none) with every rank, an all-gather (every rank's by rank) or a
    broadcast of rank 0's (a list of one). Every rank gets the same answer."""
    return {rank: problem for rank, problem in enumerate(exchange(mine)) if problem}
