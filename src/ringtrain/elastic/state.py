"""What an elastic job's state must do, for ``rt.elastic`` and ``hvd.elastic`` alike.

:class:`ElasticState` is the one base class: the reset callbacks (run on every rank after
the job changed size, e.g. to scale the learning rate) and the two operations the elastic
loop (:func:`ringtrain.elastic.resize.drive`) calls on a state, ``restore()`` (back to the
last commit after a peer failed mid-step) and ``sync()`` (take rank 0's state, after the
job changed size). :class:`~ringtrain.elastic.resume.Resumable` and Horovod's states
(:mod:`ringtrain.horovod.elastic.state`) are its subclasses, and keep their in-memory
commits with the same two functions, :func:`copy_states` and :func:`load_states`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = ["ElasticState", "HostsUpdated", "Stateful", "copy_states", "load_states"]


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (a model, optimizer, loader)."""

    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> Any: ...


class HostsUpdated(RuntimeError):
    """ringrun has a newer world for the job; raised at a commit so every rank moves to
    it at the same point (``hvd.elastic.HostsUpdatedInterrupt`` is one)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


class ElasticState:
    """Base of every elastic state: reset callbacks, and what the elastic loop calls."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Called on every rank after the job changed size (e.g. to scale the rate) or,
        for Horovod's states, was restarted and resumed from a commit."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for cb in self._reset_callbacks:
            cb()

    def drop_steps(self) -> None:
        """Forget the optimizers' step in progress without waiting on the broken world
        (after a peer failed, before :meth:`restore`; not collective)."""

    def restore(self) -> None:
        """Go back to the last commit (after a peer failed mid-step)."""
        raise NotImplementedError

    def sync(self) -> None:
        """Every rank takes rank 0's state (collective; after the job changed size)."""
        raise NotImplementedError


def copy_states(parts: Mapping[str, Stateful | None]) -> dict[str, Any]:
    """What a commit keeps in memory: a deep copy of each part's ``state_dict()`` (None for
    a part that is None), so training on does not change it."""
    return {name: copy.deepcopy(part.state_dict()) if part is not None else None
            for name, part in parts.items()}


def load_states(parts: Mapping[str, Stateful | None], states: Mapping[str, Any]) -> None:
    """Give each part its state from ``states`` (a commit); a part or a state that is None
    is left as it is."""
    for name, part in parts.items():
        if part is not None and states.get(name) is not None:
            part.load_state_dict(states[name])
