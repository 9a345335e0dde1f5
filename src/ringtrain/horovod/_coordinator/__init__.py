"""Named, negotiated collectives: Horovod's execution model on ``torch.distributed``
(private to :mod:`ringtrain.horovod`, its only user).

Operations are matched across ranks by name, in any order, from any thread; they run
once every member of their process set submitted them; ranks that ``join()`` contribute
zeros; mismatches are errors on every rank; a missing rank is named after
``stall_timeout``. :mod:`ringtrain.horovod` is built on it. See :mod:`.engine`.
"""

from __future__ import annotations

from ringtrain.horovod._coordinator.adasum import adasum_pair, adasum_tree
from ringtrain.horovod._coordinator.engine import Engine, PendingOp
from ringtrain.horovod._coordinator.execute import Request, reducescatter_shares
from ringtrain.horovod._coordinator.process_sets import ProcessSet
from ringtrain.horovod._coordinator.requests import Meta, mismatch

__all__ = ["Engine", "Meta", "PendingOp", "ProcessSet", "Request", "adasum_pair", "adasum_tree",
           "mismatch", "reducescatter_shares"]
