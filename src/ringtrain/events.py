"""A tiny in-process event bus: where the training step reports its phases.

The optimizer and the data loader publish timed spans here ("data_wait", "h2d_copy",
"exchange", "exchange_wait", "update", "step_end"); the step meter and the timeline
(:mod:`ringtrain.observe`) subscribe. Publishers import only this leaf module, so the
layers stay independent, and with no subscriber an emit costs one list check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Listener", "active", "emit", "subscribe", "unsubscribe"]

#: ``fn(kind, t_start, t_end, info)``; times are ``time.perf_counter()`` seconds.
Listener = Callable[[str, float, float, dict[str, Any]], None]

_listeners: list[Listener] = []


def subscribe(fn: Listener) -> None:
    if fn not in _listeners:
        _listeners.append(fn)


def unsubscribe(fn: Listener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def active() -> bool:
    """Whether anyone listens (lets publishers skip building ``info``)."""
    return bool(_listeners)


def emit(kind: str, t_start: float, t_end: float, **info: Any) -> None:
    for fn in _listeners:
        fn(kind, t_start, t_end, info)
