"""The input pipeline: sample order, worker pool, shared-memory slots, device prefetch,
and a record store for millions of variable-length samples.

``rt.data.Loader`` is the entry point; see ``docs/data.md`` for the design and the
benchmark against ``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

from ringtrain.data.autotune import CpuBudget, cpu_budget
from ringtrain.data.collate import default_collate
from ringtrain.data.loader import Loader
from ringtrain.data.order import EpochPlan, FeistelPermutation, epoch_batches
from ringtrain.data.records import RecordDataset, RecordWriter
from ringtrain.data.workers import WorkerInfo, get_worker_info

__all__ = [
    "Loader",
    "RecordWriter",
    "RecordDataset",
    "default_collate",
    "get_worker_info",
    "WorkerInfo",
    "EpochPlan",
    "FeistelPermutation",
    "epoch_batches",
    "CpuBudget",
    "cpu_budget",
]
