"""The exception tree of ringtrain.

Every error a user can cause or meet is a subclass of :class:`RingtrainError`, so a
script can catch them all at once, and the command-line entry points turn them into
one line on stderr and a non-zero exit instead of a traceback.

::

    RingtrainError
    ├── ConfigError              bad argument, flag, host list or environment (fix and rerun)
    │   ├── LaunchEnvError       inconsistent launcher variables (RANK >= WORLD_SIZE, ...)
    │   └── OptimizerUsageError  the training loop calls the optimizer out of order (also an
    │                            AssertionError, as Horovod raises for the same mistakes)
    ├── NotInitializedError      a collective was used before rt.init()
    ├── CollectiveError          an exchange failed                     [recoverable]
    │   ├── MismatchError        ranks submitted different tensors       (a bug in the script)
    │   └── StallError           a rank did not arrive within stall_timeout [recoverable]
    ├── CheckpointError          a checkpoint file is missing, truncated or corrupt
    ├── DataError                dataset, record store or loader problem
    │   ├── WorkerError          a loader worker raised (its traceback is attached)
    │   └── WorkerDiedError      a loader worker exited without reporting [recoverable]
    └── LaunchError              ringrun could not start or keep the job [recoverable
                                 when a worker died; not when the command is missing]

"Recoverable" means an elastic restart (``ringrun --max-restarts``) from the latest
checkpoint can be expected to succeed: the failure came from a process or a host, not
from the script's own logic.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "DataError",
    "LaunchEnvError",
    "LaunchError",
    "LoaderTimeoutError",
    "MismatchError",
    "NotInitializedError",
    "OptimizerUsageError",
    "RingtrainError",
    "StallError",
    "WorkerDiedError",
    "WorkerError",
    "first_line",
    "rank_list",
    "ranks_phrase",
]

#: Ranks a message lists before it says how many there are in all.
RANKS_SHOWN = 8


class RingtrainError(Exception):
    """Base of every error raised by ringtrain on purpose."""

    #: Whether restarting the job from the latest checkpoint is expected to help.
    recoverable: bool = False


class ConfigError(RingtrainError, ValueError):
    """A bad argument, flag, host list or setting; the message says how to fix it."""


class LaunchEnvError(ConfigError):
    """The launcher's environment variables are partial or contradict each other."""


class OptimizerUsageError(ConfigError, AssertionError):
    """A DistributedOptimizer call out of order: ``zero_grad()`` during an exchange,
    more backward passes than ``backward_passes_per_step``, a pass after the exchange.
    An ``AssertionError`` too: Horovod raises that for these, and scripts catch it."""


class NotInitializedError(RingtrainError, RuntimeError):
    """A distributed call was made before ``rt.init()``."""


class CollectiveError(RingtrainError, RuntimeError):
    """A collective operation failed on this rank."""

    recoverable = True


class MismatchError(CollectiveError):
    """Ranks tried to exchange different tensors (names, shapes, dtypes or order)."""

    recoverable = False


class StallError(CollectiveError):
    """Some ranks did not reach an exchange within the stall timeout."""

    recoverable = True


class CheckpointError(RingtrainError, OSError):
    """A checkpoint could not be written or read back intact."""


class DataError(RingtrainError, ValueError):
    """A problem with a dataset, a record store or the loader's arguments."""


class WorkerError(DataError):
    """A loader worker raised; the worker's traceback is in the message."""


class WorkerDiedError(DataError, RuntimeError):
    """A loader worker process exited without reporting (killed, out of memory). Also a
    RuntimeError, as DataLoader's "worker (pid N) is killed by signal" is: a script's
    ``except RuntimeError:`` retry catches it here too."""

    recoverable = True


class LoaderTimeoutError(DataError, RuntimeError):
    """No batch within the loader's ``timeout``; a RuntimeError too, as DataLoader's
    "DataLoader timed out after N seconds" is."""


class LaunchError(RingtrainError, RuntimeError):
    """ringrun could not start the job or a worker failed."""


def first_line(exc: BaseException, limit: int | None = 200) -> str:
    """The first non-empty line of ``exc``'s message (its type's name when it has none),
    at most ``limit`` characters: torch's errors go on with C++ frames and hints."""
    lines = str(exc).strip().splitlines()
    line = lines[0].strip() if lines else type(exc).__name__
    if limit is None or len(line) <= limit:
        return line
    # cut at a word, and say so: a word cut in half reads as a different word
    cut = line[:limit - 3].rsplit(" ", 1)[0].rstrip(" ,;:")
    return cut + "..."


def rank_list(ranks: Iterable[int]) -> str:
    """``0, 2, 5``, in ascending order; beyond :data:`RANKS_SHOWN` ranks the rest is
    counted instead of listed (``0, 1, ..., 7, ... (64 ranks)``)."""
    rs = sorted(ranks)
    shown = ", ".join(map(str, rs[:RANKS_SHOWN]))
    return shown + (f", ... ({len(rs)} ranks)" if len(rs) > RANKS_SHOWN else "")


def ranks_phrase(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0, 2`` (see :func:`rank_list`)."""
    rs = list(ranks)
    return f"rank {rank_list(rs)}" if len(rs) == 1 else f"ranks {rank_list(rs)}"
