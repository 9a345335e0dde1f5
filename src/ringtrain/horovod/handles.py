"""Horovod's asynchronous operations: integer handles, ``poll`` and ``synchronize``.

Each ``*_async`` call describes its operation (a :class:`~ringtrain.horovod._coordinator.Meta`)
and submits it to the coordinator; the integer it returns maps to the coordinator's
handle(s) and a function that shapes the result. Names follow Horovod's: an operation
named ``x`` is ``allreduce.x``; unnamed ones are numbered per process set, so ranks that
run unnamed operations on different subsets stay in step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ringtrain.errors import CollectiveError, ConfigError
from ringtrain.horovod._coordinator import Meta, PendingOp, ProcessSet, Request
from ringtrain.horovod.basics import engine, global_process_set

__all__ = ["Adasum", "Average", "HorovodInternalError", "HorovodUsageError", "Max", "Min", "Product",
           "Sum", "check_tensor", "handle_average_backwards_compatibility", "horovod_errors", "meta_for", "op_name",
           "poll", "set_id",
           "submit", "submit_many", "synchronize", "unique_name"]

# Horovod's op constants (horovod.torch.mpi_ops), compared by value in user scripts.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "average", Sum: "sum", Adasum: "adasum", Min: "min", Max: "max", Product: "product"}


class HorovodInternalError(CollectiveError):
    """An operation failed because a rank or its connection failed (``hvd.elastic``
    restores the last committed state and continues on this error)."""


class HorovodUsageError(ConfigError, RuntimeError):
    """A call Horovod refuses with a RuntimeError (e.g. reducescatter with Adasum)."""


_handles: dict[int, tuple[list[PendingOp], Callable[[list[Any]], Any]]] = {}
_next_handle = itertools.count(1)
_counters: dict[tuple[str, int], itertools.count[int]] = {}


def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> int:
    """Horovod's rule for the deprecated ``average=`` argument."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        import warnings

        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def op_name(op: int) -> str:
    try:
        return _OP_NAMES[op]
    except (KeyError, TypeError):
        raise ValueError(f"op must be one of hvd.Average, Sum, Adasum, Min, Max, Product; got {op!r}") from None


def set_id(process_set: ProcessSet | None) -> int:
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise ValueError(f"process_set must be an hvd.ProcessSet, got {type(ps).__name__}")
    ps._check_registered()
    return ps.process_set_id


def unique_name(kind: str, name: str | None, set_id_: int) -> str:
    if name is not None:
        return f"{kind}.{name}"
    counter = _counters.setdefault((kind, set_id_), itertools.count())
    suffix = f".set{set_id_}" if set_id_ else ""
    return f"{kind}.noname{suffix}.{next(counter)}"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def check_tensor(kind: str, tensor: Any) -> None:
    """Horovod's collectives take torch tensors; a list or a NumPy array reached
    ``.dim()`` or the compressor first and failed there with an AttributeError."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{kind} needs a torch.Tensor, got {type(tensor).__name__}; "
                         "convert it first, e.g. torch.as_tensor(x)")


def meta_for(kind: str, tensor: torch.Tensor, name: str | None, process_set: ProcessSet | None,
             *, named: str | None = None, **fields: Any) -> Meta:
    """``tensor``'s request; ``named``: its full name, already reserved with
    :func:`unique_name` (else ``name`` is made one here)."""
    check_tensor(kind, tensor)
    sid = set_id(process_set)
    full = named if named is not None else unique_name(kind, name, sid)
    return Meta(full, kind, sid, _dtype_name(tensor), tuple(tensor.shape), device=tensor.device.type, **fields)


def submit(meta: Meta, request: Request | None, post: Callable[[Any], Any] = lambda r: r) -> int:
    handle = engine().submit(meta, request)
    h = next(_next_handle)
    _handles[h] = ([handle], lambda results: post(results[0]))
    return h


def submit_many(metas: Sequence[Meta], requests: Sequence[Request | None],
                post: Callable[[list[Any]], Any] = lambda r: r) -> int:
    handles = engine().submit_many(metas, requests)  # together: see Engine.submit_many
    h = next(_next_handle)
    _handles[h] = (handles, post)
    return h


def poll(handle: int) -> bool:
    """Whether the operation has finished (``synchronize`` then returns at once).

    A handle that was never returned, or that ``synchronize`` already cleared, is a
    ValueError, as Horovod's (its handle manager's ``std::invalid_argument``): it said
    True here, so a loop ``while not hvd.poll(h)`` over a stale handle went on as if
    its operation had finished."""
    if callable(handle):  # sparse_allreduce_async's result: synchronize calls it
        return True
    if handle not in _handles:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return all(h.done() for h in _handles[handle][0])


def synchronize(handle: Any) -> Any:
    """Wait for the operation and return its result (None for an unknown handle, as
    Horovod); a callable handle (``sparse_allreduce_async``) is called."""
    if callable(handle):
        return handle()
    if handle not in _handles:
        return None
    handles, post = _handles.pop(handle)
    results = []
    for h in handles:
        with horovod_errors():
            results.append(h.wait())
    return post(results)


@contextlib.contextmanager
def horovod_errors() -> Iterator[None]:
    """A failure a restart can recover from (a rank gone, a stall) surfaces as
    Horovod's ``HorovodInternalError``, which ``hvd.elastic`` and scripts catch."""
    try:
        yield
    except CollectiveError as exc:
        if exc.recoverable and not isinstance(exc, HorovodInternalError):
            raise HorovodInternalError(str(exc)) from exc
        raise
