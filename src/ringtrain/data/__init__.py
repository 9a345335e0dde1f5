"""The input pipeline: sample order, worker pool, shared-memory slots, device prefetch,
a record store for millions of variable-length samples, and readers for the formats
people have (image folders, WebDataset tar shards, Parquet; shards by URL).

``rt.data.Loader`` is the entry point; see ``docs/data.md`` for the design and the
benchmark against ``torch.utils.data.DataLoader``.
"""

from __future__ import annotations

from ringtrain.cpus import CpuBudget, cpu_budget
from ringtrain.data.collate import default_collate
from ringtrain.data.decode import decode_image
from ringtrain.data.decodecrop import DecodeCrop
from ringtrain.data.imagefolder import ImageFolder
from ringtrain.data.loader import Loader
from ringtrain.data.order import EpochPlan, FeistelPermutation, ShardPlan, epoch_batches
from ringtrain.data.parquet import ParquetDataset
from ringtrain.data.records import RecordDataset, RecordShards, RecordWriter
from ringtrain.data.remote import ShardCache
from ringtrain.data.shards import Shards, StreamShards
from ringtrain.data.tar import TarShards
from ringtrain.data.workers import WorkerInfo, get_worker_info

__all__ = [
    "Loader",
    "RecordWriter",
    "RecordDataset",
    "RecordShards",
    "ImageFolder",
    "TarShards",
    "ParquetDataset",
    "Shards",
    "StreamShards",
    "ShardCache",
    "ShardPlan",
    "decode_image",
    "DecodeCrop",
    "default_collate",
    "get_worker_info",
    "WorkerInfo",
    "EpochPlan",
    "FeistelPermutation",
    "epoch_batches",
    "CpuBudget",
    "cpu_budget",
]
