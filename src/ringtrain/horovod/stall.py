"""Horovod's stall check, as the drop-in's operations follow it.

Horovod warns every ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (60) about an operation some
ranks have not submitted, naming them, and by default never gives up
(``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` 0): a rank 0 that evaluates or writes a
checkpoint for minutes while the others wait in an allreduce is a slow step, not an
error. ``hvd`` scripts get the same. A limit is opt-in: the shutdown time, or
ringtrain's own ``RINGTRAIN_STALL_TIMEOUT`` (``ringrun --stall-timeout``; horovodrun's
``--stall-check-shutdown-time-seconds`` sets it), which wins when both are set.
``HOROVOD_STALL_CHECK_DISABLE=1`` turns off the warnings and the shutdown. As in Horovod,
a shutdown time shorter than the warning interval is ignored, with a warning (its stall
inspector: "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than
HOROVOD_STALL_CHECK_TIME_SECONDS, will not shutdown").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from ringtrain.errors import ConfigError

__all__ = ["DEFAULT_WARNING_S", "stall_limits"]

log = logging.getLogger("ringtrain.horovod")

#: Horovod's default stall warning interval (seconds).
DEFAULT_WARNING_S = 60.0


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds >= 0; e.g. {name}=60")
    return value


def stall_limits(environ: Mapping[str, str], ringtrain_timeout: float) -> tuple[float | None, float | None]:
    """``(warn every, give up after)`` in seconds for the drop-in's operations (``None``:
    no warnings / no limit); ``ringtrain_timeout`` is the settings' stall_timeout, used
    only when ``RINGTRAIN_STALL_TIMEOUT`` is in ``environ``."""
    disabled = environ.get("HOROVOD_STALL_CHECK_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")
    every = DEFAULT_WARNING_S if disabled else _seconds(environ, "HOROVOD_STALL_CHECK_TIME_SECONDS", DEFAULT_WARNING_S)
    warning = None if disabled or every == 0 else every
    shutdown = _seconds(environ, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0)
    if environ.get("RINGTRAIN_STALL_TIMEOUT", "").strip():
        limit: float | None = ringtrain_timeout
    elif shutdown > 0 and not disabled:
        limit = shutdown
        if shutdown < every:
            # Horovod's stall inspector drops such a limit (it checks for stalls once per
            # warning interval): a rank 0 evaluating for 45 s under a 30 s limit is a
            # slow step there, and ended the job here.
            log.warning("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=%g is less than HOROVOD_STALL_CHECK_TIME_SECONDS="
                        "%g: as in Horovod, a stalled operation is never shut down; set the shutdown time "
                        "to at least the check time, or use RINGTRAIN_STALL_TIMEOUT", shutdown, every)
            limit = None
    else:
        limit = None
    return warning, limit
