"""The messages between the training process and its loader workers.

One duplex socket per worker carries small messages and descriptors; array data
never crosses it (a batch without a slot that fits travels in a shared file of its
own, :class:`Oversize`). Each message is a NamedTuple
of its own type, so code reads fields by name and dispatches on the type::

    training process -> worker                 worker -> training process
      Plan(plan_id, plan)      once per plan     Done(seq, slot_id, spec)
      MapSlot(slot_id, size)   + a descriptor    Oversize(seq, slot_id, spec, nbytes)
      UnmapSlot(slot_id)                           + a descriptor (the batch)
      Task(seq, plan_id, batch, slot_id, part)   Failed(seq, slot_id, message, error)
      Stop()                                     InitFailed(message, error)

``seq`` numbers tasks across plans (see :mod:`ringtrain.data.window`); ``slot_id`` is
``-1`` when a task has no shared-memory slot yet (the first batches size the slots).
The halves of a batch split over two workers go out as ``seq`` (part 1) and ``~seq``
(part 2), so every task in flight has a key of its own; a worker answers with the
key it was given.

On the wire a message is a plain tuple ``(tag, *fields)`` (:func:`encode`,
:func:`decode`): pickling a NamedTuple looks its class up by name and runs its
Python-level ``__new__``, about 1.5 us more per message than a tuple (measured),
which is a few percent of the training process's work per batch of tiny samples.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Task", "Plan", "MapSlot", "UnmapSlot", "Stop", "Done", "Oversize", "Failed",
           "InitFailed", "ToWorker", "FromWorker", "encode", "decode"]


# ---- training process -> worker ------------------------------------------------------
class Task(NamedTuple):
    """Load batch ``batch`` of plan ``plan_id`` into slot ``slot_id`` (``-1``: no slot);
    ``part`` 1 or 2: only its first or second half (see ``workers.split_point``)."""

    seq: int
    plan_id: int
    batch: int
    slot_id: int
    part: int = 0


class Plan(NamedTuple):
    """The plan (an ``EpochPlan`` or a ``ShardPlan``) that tasks of ``plan_id`` index.

    Sent before the first task of a plan; a worker keeps this plan and the one before.
    """

    plan_id: int
    plan: Any


class MapSlot(NamedTuple):
    """Map slot ``slot_id`` of ``size`` bytes; its descriptor follows on the socket."""

    slot_id: int
    size: int


class UnmapSlot(NamedTuple):
    """Forget slot ``slot_id`` (it was retired: too small for the batches now seen)."""

    slot_id: int


class Stop(NamedTuple):
    """Unmap everything and exit."""


# ---- worker -> training process ------------------------------------------------------
class Done(NamedTuple):
    """Task ``seq``'s batch is in slot ``slot_id``; ``spec`` describes its fields
    (see :func:`ringtrain.data.collate.pack`)."""

    seq: int
    slot_id: int
    spec: tuple


class Oversize(NamedTuple):
    """Task ``seq``'s batch did not fit slot ``slot_id`` (or it had none): its
    ``nbytes`` bytes are in a shared file of their own, whose descriptor follows on the
    socket. ``payload`` (a buffer over that file) is filled in by the receiver once it
    has mapped it (it is never sent)."""

    seq: int
    slot_id: int
    spec: tuple
    nbytes: int
    payload: Any = None


class Failed(NamedTuple):
    """Task ``seq`` raised; ``message`` names the sample and carries the traceback;
    ``error`` is the class of what the dataset or collate raised (None when it cannot
    travel: see ``workers.error_class``), raised again as its type in the training
    process."""

    seq: int
    slot_id: int
    message: str
    error: Any = None


class InitFailed(NamedTuple):
    """``worker_init_fn`` raised (``error``: as in :class:`Failed`); the worker has exited."""

    message: str
    error: Any = None


ToWorker = Task | Plan | MapSlot | UnmapSlot | Stop
FromWorker = Done | Oversize | Failed | InitFailed

_KINDS: tuple[type, ...] = (Task, Plan, MapSlot, UnmapSlot, Stop, Done, Oversize, Failed,
                            InitFailed)
_TAG: dict[type, int] = {cls: tag for tag, cls in enumerate(_KINDS)}


def encode(msg: ToWorker | FromWorker) -> tuple:
    """The wire form of ``msg``: ``(tag, *fields)`` (an Oversize without its payload)."""
    if type(msg) is Oversize:
        return (_TAG[Oversize], *msg[:4])
    return (_TAG[type(msg)], *msg)


_OVERSIZE = _TAG[Oversize]


def decode(wire: tuple) -> ToWorker | FromWorker:
    """The message ``wire`` encodes (``tuple.__new__`` skips the Python-level ``__new__``)."""
    tag = wire[0]
    if tag == _OVERSIZE:
        return Oversize(*wire[1:])
    return tuple.__new__(_KINDS[tag], wire[1:])  # type: ignore[no-any-return]
