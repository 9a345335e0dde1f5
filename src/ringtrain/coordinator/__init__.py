"""Named, negotiated collectives: Horovod's execution model on ``torch.distributed``.

Operations are matched across ranks by name, in any order, from any thread; they run
once every member of their process set submitted them; ranks that ``join()`` contribute
zeros; mismatches are errors on every rank; a missing rank is named after
``stall_timeout``. :mod:`ringtrain.horovod` is built on it. See :mod:`.engine`.
"""

from __future__ import annotations

from ringtrain.coordinator.adasum import adasum_pair, adasum_tree
from ringtrain.coordinator.engine import Engine, Handle
from ringtrain.coordinator.execute import Request, reducescatter_shares
from ringtrain.coordinator.process_sets import ProcessSet
from ringtrain.coordinator.requests import Meta, mismatch

__all__ = ["Engine", "Handle", "Meta", "ProcessSet", "Request", "adasum_pair", "adasum_tree",
           "mismatch", "reducescatter_shares"]
