"""Which failures of ``torch.distributed`` mean that a peer or the store went away.

Two parts of ringtrain act on it: the stall check (:mod:`ringtrain.sync.stall`) names
the missing ranks instead of passing torch's error on, and a resizable job
(:mod:`ringtrain.elastic.resize`) moves to ringrun's next world instead of failing.
Both ask :func:`classify`, which decides by the exception's type where torch gives one
that says it:

======================================  ==========================================
``DistNetworkError``, ``ConnectionError``  :attr:`Failure.PEER_GONE` (a connection to a
                                        peer or to the store broke or never came)
``DistStoreError``                      :attr:`Failure.TIMEOUT` (a store wait ran out)
======================================  ==========================================

and by :data:`TEXT_TABLE`, one table of message fragments, where only text exists: torch
2.13 raises Gloo's failures as plain ``RuntimeError`` ("[.../gloo/transport/tcp/
pair.cc:553] Connection closed by peer [127.0.0.1]:4239. This is typically caused by a
remote worker crashing...", "[.../unbound_buffer.cc:78] Timed out waiting 1000ms for
recv operation to complete"), and NCCL's ``DistBackendError`` says what happened only
in its text. tests/unit/core/test_peer_failure.py holds the real messages torch 2.13
produces for Gloo and the store, and produces the Gloo ones live, so a rewording in a
new torch fails that test instead of silently changing recovery.
"""

from __future__ import annotations

import enum

import torch.distributed as dist

from ringtrain.errors import CollectiveError, RingtrainError

__all__ = ["TEXT_TABLE", "Failure", "classify", "is_world_failure"]


class Failure(enum.Enum):
    """What a failed distributed call says about the job."""

    #: The other end went away: closed, reset or refused the connection, or died.
    PEER_GONE = "peer gone"
    #: The call waited past a timeout (a peer may be stuck, slow or gone).
    TIMEOUT = "timeout"
    #: Another error of the backend or the store's transport: a lost peer is likely,
    #: but the message does not say which failure it was.
    TRANSPORT = "transport"


#: Lower-case fragments of torch's messages and what they mean, first match wins (so
#: "Connection closed" is PEER_GONE before "connection" is TRANSPORT).
TEXT_TABLE: tuple[tuple[str, Failure], ...] = (
    # Gloo's pair.cc and the store's socket layer when the other side went away.
    ("connection closed", Failure.PEER_GONE),
    ("connection reset", Failure.PEER_GONE),
    ("broken pipe", Failure.PEER_GONE),
    ("connection refused", Failure.PEER_GONE),
    ("remote worker crashing", Failure.PEER_GONE),
    ("failed to recv", Failure.PEER_GONE),
    ("socket closed", Failure.PEER_GONE),
    # NCCL's ncclRemoteError: "A call failed possibly due to a network error or a
    # remote process exiting prematurely."
    ("remote process exit", Failure.PEER_GONE),
    ("ncclremoteerror", Failure.PEER_GONE),
    # Gloo's "Timed out waiting 1000ms for recv operation to complete", torch's
    # "Operation timed out!" (work.wait(timeout)), the store's "wait timeout after".
    ("timed out", Failure.TIMEOUT),
    ("timeout", Failure.TIMEOUT),
    # Anything else from the backends or the store.
    ("gloo", Failure.TRANSPORT),
    ("nccl", Failure.TRANSPORT),
    ("connection", Failure.TRANSPORT),
    ("socket", Failure.TRANSPORT),
    ("store", Failure.TRANSPORT),
)


def _by_text(text: str) -> Failure | None:
    low = text.lower()
    return next((kind for fragment, kind in TEXT_TABLE if fragment in low), None)


def classify(exc: BaseException) -> Failure | None:
    """What ``exc``, raised by a ``torch.distributed`` call, says about the job; None
    when it is not a failure of the backend, the store or a connection (a bad shape, a
    script's own error)."""
    if isinstance(exc, (dist.DistNetworkError, ConnectionError)):
        return Failure.PEER_GONE
    if isinstance(exc, dist.DistStoreError):
        return Failure.TIMEOUT
    if not isinstance(exc, RuntimeError):
        return None
    found = _by_text(str(exc))
    if found is None and isinstance(exc, dist.DistError):
        return Failure.TRANSPORT  # a backend error whose words the table does not know
    return found


def is_world_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is what a lost peer causes (a resizable job then moves to its next
    world) rather than the script's own error. ringtrain's own errors say it themselves
    (:attr:`~ringtrain.errors.RingtrainError.recoverable` of a collective's error)."""
    if isinstance(exc, RingtrainError):
        return isinstance(exc, CollectiveError) and exc.recoverable
    return classify(exc) is not None
