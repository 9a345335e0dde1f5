"""Horovod's timeline from the environment (``hvd.start_timeline`` is in :mod:`.basics`).

``HOROVOD_TIMELINE=<path>`` starts one at ``init()`` (``DYNAMIC`` means: only through
``start_timeline``), ``HOROVOD_TIMELINE_MARK_CYCLES=1`` marks each coordinator cycle.
The trace format is described in :mod:`ringtrain.horovod._coordinator.trace`.
"""

from __future__ import annotations

import os

from ringtrain.horovod._coordinator import Engine

__all__ = ["start_from_env"]


def start_from_env(eng: Engine) -> None:
    path = os.environ.get("HOROVOD_TIMELINE", "")
    if path and path.upper() != "DYNAMIC":
        mark = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "").lower() in ("1", "true", "yes")
        eng.trace.start(path, mark)
