"""``hvd.add_process_set`` / ``hvd.remove_process_set`` (collective: every rank calls
them, in the same order, with the same ranks)."""

from __future__ import annotations

from collections.abc import Sequence

from ringtrain.horovod._coordinator import ProcessSet
from ringtrain.horovod.basics import engine

__all__ = ["ProcessSet", "add_process_set", "remove_process_set"]


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (or a list of ranks) on every rank; returns it."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    return engine().add_process_set(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set; False if it was not registered (or is the global one)."""
    return engine().remove_process_set(process_set)
