"""Horovod's timeline from the environment (``hvd.start_timeline`` is in :mod:`.basics`).

``HOROVOD_TIMELINE=<path>`` starts one at ``init()`` (``DYNAMIC`` means: only through
``start_timeline``), ``HOROVOD_TIMELINE_MARK_CYCLES=1`` marks each coordinator cycle.
The trace format is described in :mod:`ringtrain.horovod._coordinator.trace`.

Horovod's writer puts every event in the file as it happens, so the timeline is there
whether or not the script calls ``hvd.shutdown()`` or ``hvd.stop_timeline()``, and most
scripts (Horovod's examples among them) call neither. Rank 0 here writes the file when
the timeline stops, so a timeline still recording is stopped, and written, at exit.
When ringtrain's own timeline (``RINGTRAIN_TIMELINE``) names the same file, as
``horovodrun --timeline-filename`` asks for both, the file gets both: the step trace
is written again around the Horovod events (:func:`ringtrain.observe.timeline.write_trace`).
"""

from __future__ import annotations

import atexit
import os
import weakref
from pathlib import Path

from ringtrain.horovod._coordinator import Engine
from ringtrain.observe import session

__all__ = ["start_from_env", "stop_at_exit"]

# The engines whose timeline may still be recording at exit (init() after shutdown()
# makes a new one); weak, so a finished engine is not kept alive for this.
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_registered = False


def start_from_env(eng: Engine) -> None:
    global _registered
    path = os.environ.get("HOROVOD_TIMELINE", "")
    if path and path.upper() != "DYNAMIC":
        mark = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "").lower() in ("1", "true", "yes")
        eng.trace.start(path, mark)
    # hvd.start_timeline() may start one later: stop whatever records at exit. Registered
    # at init(), before basics' own exit hook, so it runs after the coordinator stopped.
    _engines.add(eng)
    if not _registered:
        atexit.register(stop_at_exit)
        _registered = True


def stop_at_exit() -> None:
    """Stop (and so write) every timeline still recording; called at exit."""
    for eng in list(_engines):
        written = eng.trace.stop()  # the path rank 0 wrote; None on other ranks or if stopped
        if written is None:
            continue
        ours = session.current()
        if ours is not None and ours.timeline_path and _same_file(ours.timeline_path, written):
            # ringtrain's timeline was written to this file before: write it again,
            # keeping the Horovod events now there.
            ours.rewrite_timeline()


def _same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    return Path(a).resolve() == Path(b).resolve()
