"""Gradient-exchange strategies: native, ring and parameter server, with safety checks.

::

    native   the backend's allreduce (NCCL ring/tree on GPUs, Gloo on CPUs); the default
    ring     chunked, pipelined ring-allreduce on point-to-point operations  (ring.py)
    ps       parameter server on ranks 0..k-1, k = ps_servers                (ps.py)

Each is an allreduce algorithm object, ``strategy(tensor, op, name) -> Handle``, usable
as ``rt.allreduce(t, algorithm=...)`` and ``DistributedOptimizer(strategy=...)``.
Importing this package registers ``"ring"`` and ``"ps"`` with
:mod:`ringtrain.collectives`.

Around the strategies: :mod:`~ringtrain.sync.signature` compares what ranks will
exchange at the first step (MismatchError), :mod:`~ringtrain.sync.stall` names the ranks
missing from an exchange that does not finish within ``stall_timeout`` (StallError),
and :mod:`~ringtrain.sync.channel` is the private Gloo group plus exchange thread the
point-to-point strategies run on. See docs/sync.md for measurements.
"""

from __future__ import annotations

from ringtrain import collectives, runtime
from ringtrain.sync import channel as _channel
from ringtrain.sync import stall as _stall
from ringtrain.sync.native import Native
from ringtrain.sync.ps import ParameterServer
from ringtrain.sync.ring import Ring
from ringtrain.sync.signature import check_exchange, check_signature, entry
from ringtrain.sync.stall import tracker
from ringtrain.sync.strategy import STRATEGIES, P2PStrategy, Strategy, make_strategy

__all__ = [
    "Strategy",
    "P2PStrategy",
    "Native",
    "Ring",
    "ParameterServer",
    "STRATEGIES",
    "make_strategy",
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


runtime.add_shutdown_hook(close)

# Defaults read stall_timeout from the settings at each call.
collectives.register_algorithm("ring", Ring())
collectives.register_algorithm("ps", ParameterServer())
