"""``rt.data.Loader``: the input pipeline that keeps the device busy.

How a batch reaches the training loop with ``num_workers > 0``::

    parent: pick batch k, a free slot s, an idle worker  --Task(k, s)-->  worker
    worker: indices = order(k); samples = dataset[...]; collate into slot s
    worker  --Done(k, s, spec)-->  parent: batch = views of slot s (no copy)
    user drops the batch  ->  weak reference fires  ->  slot s is free again

Batches are delivered in order and are safe to keep: a slot is only reused once
every tensor of the batch built on it is gone. If the loop keeps more than ``keep``
batches alive, further batches are copied out of their slot (one memcpy) so the
workers never run out of slots. On CUDA, batches are copied from the page-locked
slot on a side stream ``device_prefetch`` batches ahead and the slot is reused once
the copy event has completed (see :mod:`ringtrain.data.prefetch`).
"""

from __future__ import annotations

import logging
import math
import numbers
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

# runtime at import, not at the first iter(): its import (6-10 ms here: the launch
# environment, settings and membership modules) otherwise lands in the first batch's
# latency when the script has not called rt.init() (a one-process job, or a loader
# built before init).
from ringtrain import events, runtime
from ringtrain.cpus import CpuBudget, cpu_budget
from ringtrain.data.autotune import Autotuner, initial_workers
from ringtrain.data.collate import fresh_alloc
from ringtrain.data.feed import WorkerFeed
from ringtrain.data.order import BatchIndexer, EpochPlan, ShardIndexer, ShardPlan, Stage, epoch_batches
from ringtrain.data.prefetch import CudaBackend, DeviceStager, StagerBackend
from ringtrain.data.protocol import Failed
from ringtrain.data.workers import SampleError, load_batch, prefetch_next
from ringtrain.errors import DataError

__all__ = ["Loader"]

log = logging.getLogger("ringtrain.data")

_STATE_VERSION = 1


def _runtime_world() -> tuple[int, int, int]:
    """(rank, world size, processes on this host): see ringtrain.runtime.job_world."""
    return runtime.job_world()


def _unjoined_job() -> tuple[int, int, str] | None:
    """(rank, size, launcher) of a job of several processes that the launch environment
    names but this process has not joined (no ``rt.init()``, no process group), else
    None. The loader then shards over a world of one: every rank reads every sample."""
    if _runtime_world()[1] > 1:
        return None
    return runtime.launched_world()


# DataLoader's (and StatefulDataLoader's) arguments the Loader does not take, and what
# to write instead: a script moved from DataLoader gets the fix in one line.
_DATALOADER_ONLY = {
    "sampler": "it picks and splits the samples itself (shuffle=, seed=, drop_last=, "
               "rank=/world_size=); keep DataLoader for a custom sampler",
    "batch_sampler": "it makes the batches itself (batch_size=, drop_last=, shuffle=, seed=); "
                     "keep DataLoader for a custom batch sampler",
    "generator": "pass seed= (the order is a pure function of seed, epoch, rank and world size)",
    "persistent_workers": "its workers stay up across epochs already: drop the argument",
    "prefetch_factor": "pass prefetch=N, the batches loaded ahead in all (default 4 per worker)",
    "multiprocessing_context": "pass start_method= ('fork', 'forkserver' or 'spawn')",
    "pin_memory_device": "batches go to device= (staged through pinned memory on CUDA)",
    "in_order": "its batches always come in order: drop the argument",
    "snapshot_every_n_steps": "its state_dict() is exact at every batch: drop the argument",
}


def _refuse_dataloader_only(given: dict[str, Any]) -> None:
    """A DataLoader argument is a DataError naming what to use; any other unknown one is
    the TypeError Python gives."""
    for name in given:
        if name in _DATALOADER_ONLY:
            raise DataError(f"rt.data.Loader takes no {name}=: {_DATALOADER_ONLY[name]}")
    if given:
        raise TypeError(f"Loader.__init__() got an unexpected keyword argument {next(iter(given))!r}")


def _runtime_device() -> torch.device:
    try:
        return runtime.device()
    except Exception:
        return torch.device("cpu")


def _make_backend(device: torch.device) -> StagerBackend:
    """The device runtime for the stager (tests substitute a fake)."""
    if not torch.cuda.is_available():
        raise DataError(f"the loader's device is {device} but CUDA is not available; "
                        "pass device='cpu' (or leave device unset to use rt.device())")
    return CudaBackend(device)


def _describer(loader_ref: weakref.ref) -> Callable[[int], str]:
    """Names batch k for error messages, without keeping the loader alive."""
    def describe(k: int) -> str:
        loader = loader_ref()
        return loader._describe(k) if loader is not None else f"batch {k}"
    return describe


def _stages(saved: Any) -> tuple[Stage, ...]:
    """The ``resumed`` stages of a loader state, checked for shape (ShardPlan checks sizes)."""
    try:
        stages = tuple((int(w), int(b), int(c)) for w, b, c in saved)
    except (TypeError, ValueError):
        raise DataError(f"loader state has resumed={saved!r}, not a list of [world_size, "
                        "batch_size, position]; resume from a state Loader.state_dict() "
                        "wrote") from None
    return stages


def _check_kind(dataset: Any) -> bool:
    """True for a sharded dataset, False for a map-style one; else a clear error."""
    name = type(dataset).__name__
    iterable = isinstance(dataset, torch.utils.data.IterableDataset)
    if hasattr(dataset, "shard_sizes"):
        if not (hasattr(dataset, "__getitems__") or hasattr(dataset, "__getitem__")):
            raise DataError(f"the sharded dataset {name} has shard_sizes but no __getitems__ "
                            "(or __getitem__) to read samples by index; see rt.data.Shards")
        return True
    if not iterable and hasattr(dataset, "__len__") and (hasattr(dataset, "__getitem__")
                                                         or hasattr(dataset, "__getitems__")):
        return False
    if hasattr(dataset, "__iter__"):
        raise DataError(
            f"{name} is an iterable dataset without shards, not a map-style one: the loader "
            "splits shards across ranks and workers and resumes by sample count, so it needs "
            "them; wrap it as rt.data.StreamShards(shards, iterate) (iterate(shard) yields "
            "that shard's samples), or read the data with rt.data.TarShards, ParquetDataset "
            "or ImageFolder")
    raise DataError(f"{name} is not a map-style dataset; give it __len__ and __getitem__ "
                    "(or use a sharded dataset, see rt.data.Shards)")


def _image_decoding(dataset: Any) -> str | None:
    """How the dataset decodes images, for the doctor: ``"whole"`` (whole images, then
    any crop), ``"DecodeCrop"`` / ``"DecodeCrop(cuda)"``, or None (not known)."""
    from ringtrain.data.decodecrop import DecodeCrop

    transform = getattr(dataset, "transform", None)
    if isinstance(transform, DecodeCrop):
        return "DecodeCrop(cuda)" if transform.device.type == "cuda" else "DecodeCrop"
    if getattr(dataset, "decode", False) is True and hasattr(dataset, "classes"):
        return "whole"  # an ImageFolder that decodes every file whole
    return None


class _EpochIterator:
    __slots__ = ("_loader", "_gen", "__weakref__")

    def __init__(self, loader: Loader, gen: int) -> None:
        self._loader, self._gen = loader, gen

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        events.check_stop()  # `ringtrain doctor` has its steps: leave before the next batch
        loader = self._loader
        if self._gen != loader._gen and loader._skip is not None and loader._skip[0] == self._gen:
            # The loop caught the error of this iterator's last next() and goes on:
            # as DataLoader's iterator does, it gets the batches after the failed one.
            self._gen = loader._resume_after_error(self)
        return loader._next(self._gen)

    def __len__(self) -> int:
        plan = self._loader._plan
        return 0 if plan is None else plan.num_batches


class Loader:
    """Batches of a map-style or sharded dataset, loaded by worker processes through
    shared memory.

    Args:
        dataset: anything with ``__len__`` and ``__getitem__`` (``__getitems__(indices)``
            is used when present, one call per batch); or a sharded dataset (it has
            ``shard_sizes``: :class:`ringtrain.data.Shards`, ``TarShards``,
            ``ParquetDataset``, ``RecordShards``, ``StreamShards``), whose shards are
            split across ranks (:class:`ringtrain.data.order.ShardPlan`).
        batch_size: samples per batch on each rank.
        shuffle: a fresh pseudo-random order each epoch (a pure function of seed, epoch).
        seed: the order's and the workers' augmentation RNG seed.
        num_workers: worker processes; ``0`` loads in the training process; ``"auto"``
            picks from the CPU budget and adapts (``loader.num_workers`` shows it).
        device: where batches are delivered; default ``rt.device()``. On CUDA, slots are
            page-locked and copies run on a side stream ahead of the loop.
        drop_last: drop the tail that does not fill a batch on every rank (else pad by
            wrapping around, so each rank gets the same number of batches).
        collate_fn: ``f(list of samples) -> batch`` (runs in the workers). When it has an
            ``on_device(batch, device)`` method (``DecodeCrop(device="cuda").collate``),
            the loader runs that on each batch in the training process before handing it
            over: on CUDA on its side stream, ahead of the loop (GPU decode).
        prefetch: batches loaded ahead of the training loop (default 4 per worker; 2 for batches over 8 MiB).
        rank, world_size: this process's shard; default from ``rt.init()`` or 0 / 1
            (a warning when the launcher started several processes not joined).
        start_method: ``"fork"`` (default on Linux), ``"forkserver"`` or ``"spawn"``.
        worker_init_fn: ``f(worker_id)`` run once in each worker.
        seed_workers: seed ``random``/``numpy``/``torch`` in workers per batch (per half
            batch, see ``workers.halves``) from its position, so augmentations do not
            depend on which worker loads it. ``False``: as DataLoader, worker ``i`` is
            seeded once with a base drawn from torch's default generator plus ``i``,
            and batches go to the workers in turn (repeats under ``torch.manual_seed``
            with a fixed ``num_workers``).
        zero_copy: hand out views of the shared slots (``False``: always copy out).
        keep: zero-copy batches the loop may hold at once before later ones are copied.
        pin_memory: page-lock slots for the CUDA copy (default: when device is CUDA).
        device_prefetch: batches copied to the device ahead of the loop.
        timeout: seconds to wait for one batch before raising (default: no limit;
            a dead worker is reported at once either way).
        max_workers: upper bound for ``num_workers="auto"``.
    """

    #: The loader reports its own data waits on the event bus, so
    #: ``rt.observe.instrument(loader)`` returns it unwrapped (no double counting).
    publishes_data_wait = True

    def __init__(self, dataset: Any, batch_size: int = 256, shuffle: bool = True,
                 seed: int = 0, num_workers: int | str = "auto",
                 device: torch.device | str | None = None, drop_last: bool = False, *,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 prefetch: int | None = None, rank: int | None = None,
                 world_size: int | None = None, start_method: str | None = None,
                 worker_init_fn: Callable[[int], None] | None = None,
                 seed_workers: bool = True, zero_copy: bool = True, keep: int = 4,
                 pin_memory: bool | None = None, device_prefetch: int = 2,
                 timeout: float | None = None, max_workers: int | None = None,
                 **dataloader_only: Any) -> None:
        _refuse_dataloader_only(dataloader_only)
        self._sharded = _check_kind(dataset)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise DataError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"seed must be an int >= 0, got {seed!r}")
        if num_workers != "auto" and (isinstance(num_workers, bool) or
                                      not isinstance(num_workers, int) or num_workers < 0):
            raise DataError(f"num_workers must be an int >= 0 or 'auto', got {num_workers!r}")
        for name, value in (("keep", keep), ("device_prefetch", device_prefetch)):
            if not isinstance(value, int) or value < 1:
                raise DataError(f"{name} must be an int >= 1, got {value!r}")
        if prefetch is not None and (not isinstance(prefetch, int) or prefetch < 1):
            raise DataError(f"prefetch must be an int >= 1, got {prefetch!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 < timeout < math.inf):
            raise DataError(f"timeout must be a number of seconds > 0, or None for no limit, got {timeout!r}")
        if max_workers is not None and (isinstance(max_workers, bool)
                                        or not isinstance(max_workers, int) or max_workers < 1):
            raise DataError(f"max_workers must be an int >= 1 (or None: twice the CPU budget), "
                            f"got {max_workers!r}")
        if max_workers is not None and num_workers != "auto":
            warnings.warn(f"max_workers={max_workers} has no effect with num_workers="
                          f"{num_workers!r}: it bounds num_workers='auto' only", stacklevel=2)
        for name, place in (("rank", rank), ("world_size", world_size)):
            # A str from os.environ failed later with "'<=' not supported between
            # instances of 'int' and 'str'"; a float rank gave float sample positions.
            if place is not None and (isinstance(place, bool) or not isinstance(place, numbers.Integral)):
                raise DataError(f"{name} must be an int, got {place!r}; convert it, e.g. "
                                f"{name}=int(os.environ[...]), or leave rank and world_size "
                                "unset to use rt.init()'s")
        if world_size is not None and world_size < 1:
            raise DataError(f"world_size must be >= 1, got {world_size!r}")
        if (rank is None) != (world_size is None):
            raise DataError("pass rank and world_size together (or neither, to use rt.init()'s)")
        if world_size is not None and rank is not None and not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside a world of {world_size}")

        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn
        try:
            self.device = torch.device(device) if device is not None else _runtime_device()
        except (RuntimeError, TypeError) as err:
            raise DataError(f"device {device!r} is not a torch device ({err}); give e.g. 'cpu' or 'cuda:0'") from None
        self.timeout = timeout
        self._rank = None if rank is None else int(rank)
        self._world_size = None if world_size is None else int(world_size)
        self._cuda = self.device.type == "cuda"
        self._pin = self._cuda if pin_memory is None else bool(pin_memory) and self._cuda
        if pin_memory and not self._cuda:
            # DataLoader warns too: page-locking only serves a copy to a CUDA device.
            warnings.warn(f"pin_memory=True has no effect: batches go to {self.device}, not a CUDA "
                          "device (pass device='cuda' for page-locked, overlapped copies)", stacklevel=2)
        self._device_depth = device_prefetch
        self._worker_kwargs = dict(collate_fn=collate_fn, seed=seed, seed_batches=seed_workers,
                                   start_method=start_method, worker_init_fn=worker_init_fn)
        self._check_dataset()

        # -- worker count ----------------------------------------------------------------
        self.num_workers_requested = num_workers
        self.cpu_budget: CpuBudget | None = None
        self._tuner: Autotuner | None = None
        if num_workers == "auto":
            self.cpu_budget = cpu_budget(share=_runtime_world()[2])
            start = initial_workers(self.cpu_budget)
            high = max_workers or max(start, 2 * max(1, int(self.cpu_budget.cpus)))
            start = min(start, high)  # max_workers bounds the first count too, not only growth
            self._tuner = Autotuner(start, low=1, high=high)
            self.num_workers = start
            log.info("num_workers=auto -> %d (%s)", start, self.cpu_budget.describe())
        else:
            self.num_workers = int(num_workers)

        # -- timing hooks (read by the step meter) ------------------------------------------
        self.last_wait_s = 0.0  #: how long the loop waited for the latest batch
        self.total_wait_s = 0.0  #: the same, summed since construction
        self.batches_yielded = 0

        # -- epoch state --------------------------------------------------------------------
        self._epoch = 0
        self._start = 0  # global position the next iteration of this epoch starts at
        self._resumed: tuple[Stage, ...] = ()  # a sharded epoch's stages before _start's
        # The world size _start counts in (a sharded position is per rank), None at an
        # epoch's start (any world); it differs after the job changed size mid-epoch.
        self._start_world: int | None = None
        # The epoch whose last batch the loop received, while the loader stands at the
        # start of the next one: recorded in state_dict(); and from a restored state,
        # the epoch set_epoch() finds nothing left in.
        self._finished: int | None = None
        self._restored_finished: int | None = None
        self._pending_epoch: int | None = None  # set_epoch() during a pass: the next pass's
        # The iterator of the latest pass, and of the pass that handed out its epoch's last
        # batch while its loop has not been told it ended (no StopIteration yet): a loop
        # still inside it (the iterator alive) saves a state that resumes into that
        # pass's empty rest, as StatefulDataLoader's does, not into the next epoch.
        self._iter_ref: weakref.ref[_EpochIterator] | None = None
        self._open_ref: weakref.ref[_EpochIterator] | None = None
        self._workers_len = 0  # len(dataset) when the running workers started
        self._plan: EpochPlan | ShardPlan | None = None
        self._gen = 0
        self._active = False
        self._yielded = 0
        self._staged = 0
        self._indexer: BatchIndexer | ShardIndexer | None = None
        self._gap_from: float | None = None
        self._checked_world = False  # see _warn_unjoined
        # The pass that a new pass (or load_state_dict) ended while unfinished: (its
        # generation, what ended it, epoch, batches handed out, batches in all).
        self._ended: tuple[int, str, int, int, int] | None = None
        # After a batch failed to load (an exception from the dataset, a collate_fn, a
        # worker): the failed pass's generation, where the loader stood then, and the
        # position just past the failed batch, for a loop that catches the error and
        # calls next() on the same iterator again (see _resume_after_error).
        self._skip: tuple[int, int, tuple[int, int, tuple[Stage, ...]], tuple[int, int, tuple[Stage, ...]]] | None = None

        self._on_device = getattr(collate_fn, "on_device", None)
        self._images = _image_decoding(dataset)
        stager = (DeviceStager(_make_backend(self.device), self._on_device) if self._cuda
                  else None)
        self._feed = WorkerFeed(dataset, self._worker_kwargs, keep=keep, zero_copy=zero_copy,
                                prefetch=prefetch, stager=stager, pin=self._pin,
                                device_depth=device_prefetch if self._cuda else 0)
        self._feed.describe = _describer(weakref.ref(self))
        self._stager = stager
        self._finalizer = weakref.finalize(self, self._feed.close)

    # ---- public API -------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per full epoch on this rank (the same on every rank)."""
        if self._sharded:
            return self._make_plan(0, 0, ()).num_batches
        _, world = self._shard()
        return epoch_batches(len(self.dataset), self.batch_size, world, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next iteration (keeps a resumed position).

        The epoch whose last batch the loop had received when the state was saved (a
        checkpoint at the end of an epoch, resumed with the epoch the loop was in) has
        nothing left: iterating it yields no batch, as for any other saved position in
        it, instead of running it again.
        """
        if not isinstance(epoch, int) or epoch < 0:
            raise DataError(f"epoch must be an int >= 0, got {epoch!r}")
        self._settle()
        if self._active:
            # Called during a pass: that pass goes on in its own order and ``epoch`` is
            # the next one's, as DistributedSampler.set_epoch is for a DataLoader.
            # (Before: the pass's next batch raised a bare AssertionError.) The epoch of
            # the pass itself changes nothing: the next pass is the one after it.
            plan = self._plan
            self._pending_epoch = None if plan is not None and epoch == plan.epoch else epoch
            return
        self._pending_epoch = None
        self._use_epoch(epoch)

    def _use_epoch(self, epoch: int) -> None:
        finished, self._restored_finished = self._restored_finished, None
        if epoch != self._epoch:
            self._open_ref = None  # the loader moved on from the pass's end
        if epoch == finished and self._epoch == epoch + 1 and self._start == 0:
            self._finished = None
            self._epoch, self._start, self._resumed = epoch, self._end_of(epoch), ()
            self._start_world = self._shard()[1]
            self._plan = None
        elif epoch != self._epoch:
            self._epoch, self._start, self._resumed, self._start_world = epoch, 0, (), None
            self._plan = None
            self._finished = None

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> Iterator[Any]:
        self._settle()
        if self._active:
            self._abandon("a new iter(loader)")
        self._sync()
        self._check_dataset()
        self._warn_unjoined()
        if not self._finalizer.alive:
            # close() ran (or a with-block ended): this iteration starts fresh workers,
            # which need a finalizer again, or they outlived the loader until exit.
            self._finalizer = weakref.finalize(self, self._feed.close)
        if self._sharded and self._start_world not in (None, self._shard()[1]):
            self.load_state_dict(self.state_dict())  # re-cut the rest for this world size
        plan = self._make_plan(self._epoch, self._start, self._resumed)
        if plan.num_batches == 0 and plan.start == 0:
            raise DataError(
                f"{plan.num_samples} samples give no batch of {self.batch_size} on each of "
                f"{plan.world_size} ranks with drop_last=True; lower batch_size or set "
                "drop_last=False")
        self._gen += 1
        self._plan = plan
        self._finished = self._restored_finished = None
        self._open_ref = None
        self._yielded = self._staged = 0
        self._indexer = plan.indexer()
        self._gap_from = None
        self._active = True
        if self.num_workers > 0:
            pool = self._feed.pool
            running = pool is not None and not pool.closed
            if running and len(self.dataset) != self._workers_len:
                # The workers hold the dataset as it was when they started (a fork's
                # copy): one that has since grown or shrunk is started afresh, or they
                # failed on the new indices or read the old samples.
                log.info("the dataset changed length (%d -> %d samples): starting fresh "
                         "loader workers", self._workers_len, len(self.dataset))
                self._feed.close()
                running = False
            if not running:
                self._workers_len = len(self.dataset)
                self._worker_kwargs["rank"] = plan.rank  # the workers' own seeds differ by rank
            self._feed.start(self.num_workers)
            # The epoch after this one, as it will be unless set_epoch/load_state_dict
            # say otherwise: its first batches load while this epoch ends.
            self._feed.begin(plan, self._make_plan(self._epoch + 1, 0, ()))
        it = _EpochIterator(self, self._gen)
        self._iter_ref = weakref.ref(it)
        return it

    def state_dict(self) -> dict[str, Any]:
        """Where the loop stands: resume with :meth:`load_state_dict`, no replay."""
        self._sync()
        if self._active and self._plan is not None:
            epoch, position = self._plan.epoch, self._plan.position_after(self._yielded)
            resumed = self._plan.resumed if isinstance(self._plan, ShardPlan) else ()
            world = self._plan.world_size
        else:
            epoch, position, resumed = self._epoch, self._start, self._resumed
            world = self._start_world or self._shard()[1]
        # The loop is still in a pass that handed out its epoch's last batch (its iterator
        # alive, not yet told the pass ended; or the loader stands at such a pass's empty
        # rest): a restored loader's next pass is that empty rest, so a loop resumed with
        # the epoch it was in runs no epoch twice, with or without set_epoch().
        still_in = (self._open_ref is not None and self._open_ref() is not None) or (
            not self._active and position > 0 and position == self._end_of(epoch))
        raw_epoch = epoch
        epoch, position, resumed = self._normalise(epoch, position, resumed, world)
        finished = raw_epoch if epoch > raw_epoch else self._finished
        state: dict[str, Any] = {
            "version": _STATE_VERSION, "epoch": epoch, "position": position, "seed": self.seed,
            "shuffle": self.shuffle, "num_samples": len(self.dataset),
            "batch_size": self.batch_size, "world_size": world, "drop_last": self.drop_last}
        if finished is not None and position == 0 and not resumed and finished == epoch - 1:
            state["finished_epoch"] = finished  # its last batch was received (see set_epoch)
            if still_in:
                state["in_finished_pass"] = True
        if self._sharded:
            # position: samples this rank has consumed of its range (see ShardPlan)
            state["layout"] = "shards"
            state["num_shards"] = len(self._shard_sizes())
            state["resumed"] = [list(stage) for stage in resumed]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the last batch the saved loop received.

        The batch size and world size may differ from the saved run. For a map-style
        dataset the rest of the epoch is re-sharded from the saved global position; for
        a sharded one, what each saved rank had left of its range is cut into equal
        ranges for the new ranks (see :class:`ringtrain.data.order.ShardPlan`): every
        sample of the epoch is still read once.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            # (not the whole value: a checkpoint passed by mistake prints megabytes)
            keys = f"a dict with keys {sorted(map(str, state))[:8]}" if isinstance(state, dict) else \
                type(state).__name__
            hint = (f"; pass the loader's part, e.g. state[{next(k for k in state if 'loader' in str(k))!r}]"
                    if isinstance(state, dict) and any("loader" in str(k) for k in state) else
                    "; pass what this Loader's state_dict() returned")
            raise DataError(f"not a Loader state (version {_STATE_VERSION} expected), got {keys}{hint}")
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle),
                          ("num_samples", len(self.dataset))):
            if state.get(key) != mine:
                raise DataError(f"loader state was saved with {key}={state.get(key)!r} but this "
                                f"loader has {key}={mine!r}; resume with the same dataset and seed")
        raw: tuple[Any, Any] = (state.get("epoch"), state.get("position"))
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in raw) or raw[1] < 0:
            raise DataError(f"Loader state has epoch={raw[0]!r}, position={raw[1]!r} (whole numbers, "
                            "position >= 0, expected); pass what state_dict() returned")
        epoch, position = int(raw[0]), int(raw[1])
        if not self._sharded and position > len(self.dataset):
            # state_dict() never writes one: a hand edit, which moved to the next epoch.
            raise DataError(f"Loader state has position={position}, past the end of the epoch "
                            f"({len(self.dataset)} samples); pass what state_dict() returned")
        resumed: tuple[Stage, ...] = ()
        if self._sharded:
            epoch, resumed, position = self._shard_resume(state)
        elif state.get("layout", "samples") != "samples":
            raise DataError(f"loader state is for a sharded dataset (layout "
                            f"{state.get('layout')!r}) but this loader reads a map-style one")
        if self._active:
            self._abandon("load_state_dict()")
        self._pending_epoch = None  # the state says where the next pass starts
        self._epoch, self._start, self._resumed = self._normalise(epoch, position, resumed)
        finished = state.get("finished_epoch")
        self._finished = self._restored_finished = (
            int(finished) if isinstance(finished, int) and self._start == 0
            and self._epoch == finished + 1 else self._epoch - 1 if self._epoch > epoch else None)
        self._open_ref = None
        if state.get("in_finished_pass") is True and self._finished is not None \
                and self._epoch == self._finished + 1 and self._start == 0:
            # Saved inside the pass that had handed out its last batch: stand at that
            # pass's empty rest, so the next pass (set_epoch() or not) yields nothing and
            # the one after it is the next epoch, as in the run that was not stopped.
            self._epoch, self._start = self._finished, self._end_of(self._finished)
        # A resizable job may restore before its world re-forms: pin the world size this
        # position counts in, so the next iteration (or state_dict) re-cuts it if it changed.
        self._start_world = self._shard()[1]
        self._plan = None

    def close(self) -> None:
        """Stop the workers and free the shared memory (also done at exit). Iterating
        again afterwards starts fresh workers."""
        self._active = False
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def last_h2d_s(self) -> float:
        """Device time of the latest finished host-to-device copy (CUDA only)."""
        return self._stager.last_h2d_s if self._stager is not None else 0.0

    @property
    def total_h2d_s(self) -> float:
        return self._stager.total_h2d_s if self._stager is not None else 0.0

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (for monitoring; empty without workers)."""
        pool = self._feed.pool
        return [] if pool is None or pool.closed else [w.proc.pid for w in pool.workers]

    @property
    def copied_batches(self) -> int:
        """Batches copied out of their slot because the loop held ``keep`` others."""
        return self._feed.copied_batches

    @property
    def fallback_batches(self) -> int:
        """Batches that had no slot that fits and travelled in a shared file of their own
        (the first batch of each worker sizes the slots; growth)."""
        return self._feed.fallback_batches

    @property
    def ahead_batches(self) -> int:
        """Batches the loader's helper thread had received and wrapped before the loop
        asked for them (so ``next()`` only handed them over)."""
        return self._feed.ahead_batches

    def stats(self) -> dict[str, Any]:
        """Counters for logging and the step meter."""
        return {"num_workers": self.num_workers, "batches": self.batches_yielded,
                "ahead_batches": self.ahead_batches,
                "last_wait_s": self.last_wait_s, "total_wait_s": self.total_wait_s,
                "last_h2d_s": self.last_h2d_s, "total_h2d_s": self.total_h2d_s,
                "copied_batches": self.copied_batches,
                "fallback_batches": self.fallback_batches,
                "held_batches": self._feed.held_batches,
                "slots": self._feed.slot_count, "slot_bytes": self._feed.slot_bytes,
                "pinned_slots": self._feed.pinned_slots}

    # ---- set-up helpers -----------------------------------------------------------------
    def _check_dataset(self) -> None:
        n = len(self.dataset)
        if n <= 0:
            raise DataError(f"the dataset {type(self.dataset).__name__} is empty (len {n}); "
                            "give the loader at least one sample")

    def _warn_unjoined(self) -> None:
        """Once per loader: a launched job of several processes that this one has not
        joined shards over a world of one, so every process reads every sample each epoch
        (DistributedSampler raises there instead: it needs a process group)."""
        if self._checked_world or self._world_size is not None:
            return
        self._checked_world = True
        job = _unjoined_job()
        if job is not None:
            rank, size, launcher = job
            warnings.warn(
                f"this process is rank {rank} of {size} ({launcher}'s environment) but has not "
                "joined the job (no rt.init(), no torch.distributed process group), so the "
                f"loader reads the whole dataset here, as on every other rank: each sample "
                f"{size} times per epoch; call rt.init() before iterating, or pass rank= and "
                "world_size=", stacklevel=3)

    def _shard(self) -> tuple[int, int]:
        if self._rank is not None and self._world_size is not None:
            return self._rank, self._world_size
        rank, world, _ = _runtime_world()
        return rank, world

    def _shard_sizes(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.dataset.shard_sizes)

    def _make_plan(self, epoch: int, start: int,
                   resumed: tuple[Stage, ...]) -> EpochPlan | ShardPlan:
        """The order of ``epoch`` from ``start`` on (after stages ``resumed``), for this rank."""
        rank, world = self._shard()
        if self._sharded:
            return ShardPlan(self._shard_sizes(), self.batch_size, world, rank, self.shuffle,
                             self.seed, epoch, self.drop_last, start=start,
                             shuffle_within=bool(getattr(self.dataset, "random_access", True)),
                             resumed=resumed)
        return EpochPlan(len(self.dataset), self.batch_size, world, rank, self.shuffle,
                         self.seed, epoch, self.drop_last, start=start)

    def _shard_resume(self, state: dict[str, Any]) -> tuple[int, tuple[Stage, ...], int]:
        """(epoch, earlier stages, position in the last) to resume a sharded epoch from
        ``state``."""
        _, world = self._shard()
        if state.get("layout") != "shards":
            raise DataError("loader state is for a map-style dataset but this loader reads a "
                            "sharded one; resume with the same dataset")
        if state.get("num_shards") != len(self._shard_sizes()):
            raise DataError(f"loader state was saved with {state.get('num_shards')} shards but "
                            f"this dataset has {len(self._shard_sizes())}; resume with the same "
                            "shards")
        resumed = _stages(state.get("resumed", []))
        epoch, position = int(state["epoch"]), int(state["position"])
        if position == 0 and not resumed:
            return epoch, (), 0  # an epoch boundary: any world size, any batch size
        if state.get("drop_last") != self.drop_last:
            raise DataError(f"loader state was saved mid-epoch with drop_last="
                            f"{state.get('drop_last')!r} but this loader has drop_last="
                            f"{self.drop_last!r}; resume with the same drop_last")
        saved_world, saved_batch = int(state["world_size"]), int(state["batch_size"])
        saved = ShardPlan(self._shard_sizes(), saved_batch, saved_world, 0,
                          drop_last=self.drop_last, resumed=resumed)
        if position > saved.range_len:
            raise DataError(f"Loader state has position={position}, past the end of a rank's range "
                            f"of the epoch ({saved.range_len} samples); pass what state_dict() returned")
        if saved_world == world and (saved_batch == self.batch_size or not self.drop_last):
            return epoch, resumed, position  # the same ranges: go on inside them
        if position >= saved.range_len:
            return epoch + 1, (), 0  # the saved ranks had finished the epoch
        # Another world size (or batch size with drop_last): what the saved ranks had
        # left becomes the stream of a new stage of this epoch.
        return epoch, (*resumed, (saved_world, saved_batch, position)), 0

    def _normalise(self, epoch: int, position: int, resumed: tuple[Stage, ...] = (),
                   world: int | None = None) -> tuple[int, int, tuple[Stage, ...]]:
        """(epoch, position, stages), moved to the next epoch's start where this one is
        done; ``position`` counts in ``world`` ranks (default: the current world)."""
        world = world or self._shard()[1]
        if self._sharded:
            full = ShardPlan(self._shard_sizes(), self.batch_size, world, 0,
                             drop_last=self.drop_last, resumed=resumed)
            return (epoch + 1, 0, ()) if position >= full.range_len else (epoch, position, resumed)
        n = len(self.dataset)
        left = n - position
        per_rank = left // world if self.drop_last else -(-left // world)
        batches = per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)
        return (epoch + 1, 0, ()) if position >= n or batches <= 0 else (epoch, position, ())

    def _end_of(self, epoch: int) -> int:
        """The position after the last batch of ``epoch`` in this world (the loop has
        had every batch of it)."""
        if self._sharded:
            return ShardPlan(self._shard_sizes(), self.batch_size, self._shard()[1], 0,
                             drop_last=self.drop_last).range_len
        return len(self.dataset)

    def _describe(self, k: int) -> str:
        plan = self._plan
        if plan is None or not 0 <= k < plan.num_batches:
            return f"batch {k}"
        idx = plan.indexer()(k).tolist()
        shown = idx if len(idx) <= 16 else [*idx[:16], "..."]
        where = ""
        names = getattr(self.dataset, "shard_names", None)
        if self._sharded and names:
            starts = np.cumsum(self._shard_sizes())
            shards = sorted({int(np.searchsorted(starts, i, side="right")) for i in idx})
            where = "; shards " + ", ".join(names[s] for s in shards[:4])
        # k counts from the plan's start; a resumed plan starts inside the epoch.
        return (f"batch {plan.first_batch + k} of epoch {plan.epoch} (sample indices "
                f"{shown}{where})")

    def _set_workers(self, n: int) -> None:
        self.num_workers = n
        if self._feed.pool is not None:
            self._feed.start(n)

    # ---- iteration --------------------------------------------------------------------
    def _next(self, gen: int) -> Any:
        if gen != self._gen or not self._active:
            ended = self._ended
            if ended is not None and ended[0] == gen:
                # A loop still reading a pass that a new one replaced (a next(iter(loader))
                # inside it, zip(loader, loader)) ended there without a word, its epoch's
                # other batches never trained on.
                _, by, epoch, done, total = ended
                raise DataError(
                    f"this pass over the loader (epoch {epoch}, {done} of {total} batches "
                    f"handed out) was ended by {by}: a Loader runs one pass at a time. "
                    "Keep a batch this loop received instead of next(iter(loader)), or read a "
                    "second stream from a second Loader")
            if gen == self._gen:
                self._open_ref = None  # this loop is told its pass ended
            raise StopIteration
        plan = self._plan
        assert plan is not None
        if self._yielded >= plan.num_batches:
            self._settle()
            self._open_ref = None
            raise StopIteration
        t0 = time.perf_counter()
        try:
            if self._cuda:
                batch = self._next_device()
            elif self.num_workers > 0:
                loop_s = None if self._gap_from is None else t0 - self._gap_from
                batch = self._feed.next_batch(self._yielded, self.timeout, loop_s)
            else:
                batch = self._load_here(self._yielded, pinned=False)
            if self._on_device is not None and not self._cuda:
                batch = self._on_device(batch, self.device)
        except BaseException as exc:
            # This iteration is over. Iterating again starts fresh workers and goes on
            # right after the last batch handed out (as a resume from state_dict() would):
            # the batches before it were trained on already.
            resumed = plan.resumed if isinstance(plan, ShardPlan) else ()
            self._gen += 1
            self._active = False
            self._epoch, self._start, self._resumed = self._normalise(
                plan.epoch, plan.position_after(self._yielded), resumed, plan.world_size)
            self._start_world = plan.world_size
            self._skip = None
            if isinstance(exc, Exception):
                # A next() on this same iterator skips the failed batch, as DataLoader's
                # does; it used to end the epoch there (StopIteration), its other
                # batches never trained on, silently.
                self._skip = (gen, plan.epoch, (self._epoch, self._start, self._resumed), self._normalise(
                    plan.epoch, plan.position_after(self._yielded + 1), resumed, plan.world_size))
            self._feed.fail()
            raise
        t1 = time.perf_counter()
        self.last_wait_s = t1 - t0
        self.total_wait_s += self.last_wait_s
        if events.active():
            events.emit("data_wait", t0, t1, samples=plan.batch_len(self._yielded),
                        batch=self._yielded, batches=plan.num_batches, epoch=plan.epoch,
                        workers=self.num_workers, source="Loader", images=self._images)
        self._yielded += 1
        self.batches_yielded += 1
        if self._tuner is not None and self._gap_from is not None:
            change = self._tuner.observe(self.last_wait_s, t0 - self._gap_from)
            if change is not None:
                log.info("num_workers=auto -> %d (%s)", change, self._tuner.reason)
                self._set_workers(change)
        self._gap_from = time.perf_counter()
        return batch

    def _resume_after_error(self, it: _EpochIterator) -> int:
        """A next() on the iterator whose last next() raised (:attr:`_skip`): when nothing
        moved the loader since (no iter(), set_epoch() or load_state_dict()), start a
        pass just past the failed batch and hand ``it`` its generation; else ``it``'s
        own (stale: its pass is over)."""
        assert self._skip is not None
        _, epoch, stood, after = self._skip
        self._skip = None
        if self._active or (self._epoch, self._start, self._resumed) != stood:
            return it._gen
        self._epoch, self._start, self._resumed = after
        if after[0] != epoch:
            # The failed batch was the epoch's last: the pass ends here (StopIteration),
            # as DataLoader's does, and the next one is the next epoch.
            self._start_world = None
            self._finished = epoch
            return it._gen
        fresh = iter(self)
        assert isinstance(fresh, _EpochIterator)
        self._iter_ref = weakref.ref(it)
        return fresh._gen

    def _settle(self) -> None:
        """End the iteration that has handed out every batch of its epoch: the next one
        is the next epoch's. Also when the loop never asked for a batch past the last
        (``itertools.islice(loader, len(loader))``, ``zip(range(len(loader)), loader)``,
        ``next(it)`` ``len(loader)`` times): such passes used to run the same epoch, in
        the same order, again and again, while state_dict() said the next one."""
        plan = self._plan
        if self._active and plan is not None and self._yielded >= plan.num_batches:
            self._active = False
            self._epoch, self._start, self._resumed = plan.epoch + 1, 0, ()
            self._start_world = None
            self._finished = plan.epoch
            self._open_ref = self._iter_ref

    def _sync(self) -> None:
        """Outside a pass, the epoch a set_epoch() during the last one asked for."""
        self._settle()
        if not self._active and self._pending_epoch is not None:
            epoch, self._pending_epoch = self._pending_epoch, None
            self._use_epoch(epoch)

    def _load_here(self, k: int, pinned: bool) -> Any:
        """Load batch ``k`` in this process (num_workers=0)."""
        assert self._indexer is not None
        stager = self._stager
        alloc = stager.backend.host_alloc if pinned and stager is not None else fresh_alloc
        try:
            prefetch_next(self.dataset, self._indexer, k)
            return load_batch(self.dataset, self._indexer(k), self.collate_fn, alloc)
        except SampleError as err:
            cause = err.__cause__ or err
            if hasattr(cause, "add_note"):
                cause.add_note(f"(ringtrain loader: while loading sample index {err.index})")
            raise cause from None

    def _next_device(self) -> Any:
        """Stage up to ``device_prefetch`` batches on the side stream, pop the oldest."""
        stager, plan = self._stager, self._plan
        assert stager is not None and plan is not None
        k = self._yielded
        while self._staged < plan.num_batches and len(stager) < self._device_depth:
            j = self._staged
            if j != k:
                ahead = self._feed.peek(j) if self.num_workers else None
                if ahead is None or type(ahead) is Failed:
                    break  # never wait for (or fail on) a batch the loop does not need yet
            if self.num_workers == 0:
                pinned = self._pin and self.collate_fn is None  # a collate_fn allocates its own
                stager.stage(self._load_here(j, pinned=pinned), pinned, None)
            else:
                host, pinned, release = self._feed.host_batch(
                    self._feed.take(j, self.timeout), device=True)
                stager.stage(host, pinned, release)
            self._staged += 1
        return stager.pop()

    def _abandon(self, by: str) -> None:
        """Forget an unfinished iteration (the loop broke out of it, or ``by`` ended it
        under a loop that goes on: its iterator says so, see :meth:`_next`)."""
        plan = self._plan
        if plan is not None:
            self._ended = (self._gen, by, plan.epoch, plan.first_batch + self._yielded,
                           plan.first_batch + plan.num_batches)
        self._feed.abandon()
        self._active = False
        self._gen += 1
