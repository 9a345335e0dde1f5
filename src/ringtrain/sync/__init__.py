"""Gradient-exchange strategies: native, ring and parameter server, with safety checks.

::

    native   the backend's allreduce (NCCL ring/tree on GPUs, Gloo on CPUs); the default
    ring     chunked, pipelined ring-allreduce on point-to-point operations  (ring.py)
    ps       parameter server on ranks 0..k-1, k = ps_servers                (ps.py)

Each is an allreduce algorithm object, ``strategy(tensor, op, name) -> Handle``, usable
as ``rt.allreduce(t, algorithm=...)`` and ``DistributedOptimizer(strategy=...)``. The
classes share :mod:`~ringtrain.sync.base`; :mod:`~ringtrain.sync.table` is the one list
of them. Importing this package registers nothing: ``rt.init()`` hands
:func:`~ringtrain.sync.table.resolve` to the collectives and :func:`close` to the
runtime's shutdown (see :mod:`ringtrain.wiring`).

Around the strategies: :mod:`ringtrain.agreement.signature` compares what ranks will
exchange at the first step (MismatchError), :mod:`~ringtrain.sync.stall` names the ranks
missing from an exchange that does not finish within ``stall_timeout`` (StallError),
:mod:`~ringtrain.sync.channel` is the exchange thread the point-to-point strategies run
on, and :mod:`~ringtrain.sync.transport` what it runs over: a private Gloo group on host
memory for CPU tensors, an NCCL group on the GPU for CUDA tensors (no staging through
the host). See docs/sync.md for measurements.
"""

from __future__ import annotations

from ringtrain.agreement.signature import check_exchange, check_signature, entry
from ringtrain.sync import channel as _channel
from ringtrain.sync import stall as _stall
from ringtrain.sync.base import P2PStrategy, Strategy
from ringtrain.sync.native import Native
from ringtrain.sync.ps import ParameterServer
from ringtrain.sync.ring import Ring
from ringtrain.sync.stall import tracker
from ringtrain.sync.table import STRATEGIES, make_strategy, resolve

__all__ = [
    "Strategy",
    "P2PStrategy",
    "Native",
    "Ring",
    "ParameterServer",
    "STRATEGIES",
    "make_strategy",
    "resolve",
    "check_signature",
    "check_exchange",
    "entry",
    "tracker",
    "close",
]


def close() -> None:
    """Release the exchange channel and stop stall reporting (call at shutdown; the next
    ring/ps exchange or optimizer step starts them again for the current world)."""
    _channel.close()
    _stall.close()
