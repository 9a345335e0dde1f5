"""A tiny in-process event bus: where the training step reports its phases.

The optimizer and the data loader publish timed spans here ("data_wait", "h2d_copy",
"exchange", "exchange_wait", "update", "step_end"; "opt_step" when any torch optimizer's
``step()`` returns, from the hook metering puts on them); the step meter and the
timeline (:mod:`ringtrain.observe`) subscribe, when ``rt.init()`` says so. Publishers import only
this leaf module, so the layers stay independent, and with no subscriber an emit costs
one list check.

A listener never interrupts a publisher. When ``ringtrain doctor`` has measured enough
steps, its listener calls :func:`request_stop`; the training loop reaches
:func:`check_stop` at the end of ``opt.step()`` and at the next batch, outside any
exchange, and leaves there with ``SystemExit(0)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Listener", "active", "check_stop", "emit", "request_stop", "subscribe", "unsubscribe"]

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


_stop_requested = False


def request_stop() -> None:
    """Ask the training loop to end at its next :func:`check_stop` (the doctor does)."""
    global _stop_requested
    _stop_requested = True


def check_stop() -> None:
    """Raise ``SystemExit(0)`` if a stop was requested. Called by the loop's own code at
    points where no collective is in flight, so every rank (which counts the same
    steps) leaves after the same step; SystemExit, not os._exit, lets the script's
    ``finally`` blocks and the loader's clean-up run."""
    if _stop_requested:
        raise SystemExit(0)
