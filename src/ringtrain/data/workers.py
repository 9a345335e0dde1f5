"""Loader worker processes and the training process's handle on them.

The messages (one NamedTuple each, small, over one duplex socket per worker; array
data never crosses it) are in :mod:`ringtrain.data.protocol`. A worker computes the
indices of its batch itself from the plan, loads the samples, collates them straight
into the slot and answers with the slot id and a spec of the fields (``Done``).
``Oversize`` hands over a batch that did not fit its slot (or came before slots were
sized) in a shared file of its own, so variable shapes still work.

Start method: ``fork`` where available, like torch's DataLoader on Linux: start-up is
milliseconds and the dataset is shared copy-on-write. The parent of a loader starts
no threads of its own while it forks (the helper thread is stopped first; no
pin-memory thread: slots are page-locked in place), so fork is safe here; pass
``start_method="forkserver"`` or ``"spawn"`` when *your* process runs threads that
hold locks at fork time (dataset and collate_fn must then be picklable).
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing as mp
import os
import pickle
import random
import select
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, cast

import numpy as np
import torch

from ringtrain.data.collate import (
    STREAM_MIN_BYTES,
    Alloc,
    Arena,
    SlotFull,
    StreamCollator,
    default_collate,
    fresh_alloc,
    pack,
    sample_nbytes,
    spec_nbytes,
)
from ringtrain.data.order import BatchIndexer, EpochPlan, ShardIndexer, ShardPlan, batch_seed
from ringtrain.data.protocol import (
    Done,
    Failed,
    InitFailed,
    MapSlot,
    Oversize,
    Plan,
    Stop,
    Task,
    UnmapSlot,
    decode,
    encode,
)
from ringtrain.data.shm import Slot, WorkerSlots, create_shared_fd, slot_size_for
from ringtrain.errors import DataError, WorkerDiedError, WorkerError
from ringtrain.processes import SpawnedProcess, stop_sequence

__all__ = ["WorkerInfo", "get_worker_info", "WorkerPool", "fetch", "load_batch", "prefetch_next",
           "SampleError", "halves", "split_point", "error_class", "worker_error"]

log = logging.getLogger("ringtrain.data")

# The "epoch" of a worker's own seed (see WorkerPool.worker_seed): keeps it apart from
# the batches' seeds, which are keyed by real epochs.
_WORKER_SEED_TAG = 0x574F524B4552  # "WORKER"


@dataclass(frozen=True)
class WorkerInfo:
    """What a dataset can ask inside a loader worker (``None`` in the main process)."""

    id: int
    num_workers: int
    seed: int
    dataset: Any


_WORKER_INFO: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """The current loader worker, or ``None`` in the training process."""
    return _WORKER_INFO


class SampleError(Exception):
    """A dataset call failed; carries the sample index (or indices) it was asked for."""

    def __init__(self, index: Any) -> None:
        super().__init__(index)
        self.index = index


def fetch(dataset: Any, indices: np.ndarray) -> list[Any]:
    """Load the samples at ``indices``, batched through ``__getitems__`` when offered."""
    getitems = getattr(dataset, "__getitems__", None)
    idx = indices.tolist()
    if getitems is not None:
        try:
            return list(getitems(idx))
        except Exception as err:
            raise SampleError(idx) from err
    samples: list[Any] = []
    append = samples.append
    i = -1
    try:
        for i in idx:
            append(dataset[i])
    except Exception as err:
        raise SampleError(i) from err
    return samples


def prefetch_next(dataset: Any, indexer: BatchIndexer | ShardIndexer, batch: int) -> None:
    """Ask a sharded dataset to fetch the shard this rank reads after batch ``batch``'s,
    so a remote one downloads while the current one is read (see ShardCache.prefetch)."""
    if isinstance(indexer, ShardIndexer) and hasattr(dataset, "prefetch"):
        upcoming = indexer.next_shards(batch)
        if upcoming:
            dataset.prefetch(upcoming)


def halves(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> bool:
    """Whether this loader's batches come in two halves: a map-style dataset read a
    sample at a time with the default collate. Their halves are seeded apart (each from
    its first sample's position), so the first batch of a loader that has just started
    can be loaded by two workers at once and still be the batch one worker would load.
    A ``__getitems__`` dataset (one call per batch) or a ``collate_fn`` (any output)
    keeps whole batches."""
    return (collate_fn is None and not hasattr(dataset, "__getitems__")
            and not hasattr(dataset, "shard_sizes"))


def split_point(n: int) -> int:
    """Where a batch of ``n`` samples is cut into halves (0: it is not)."""
    return n // 2 if n >= 2 else 0


def load_batch(dataset: Any, indices: np.ndarray,
               collate_fn: Callable[[list[Any]], Any] | None, alloc: Alloc,
               reseed: tuple[int, Callable[[], None]] | None = None,
               half: bool = False) -> Any:
    """Fetch and collate one batch; large samples are copied into it as they arrive.
    ``reseed``: ``(k, f)``, call ``f()`` right before fetching the ``k``-th sample
    (``k >= 1``; the second half's seed, see :func:`halves`). ``half``: the samples are
    half a batch; numbers stay as given (``collate.join_halves`` types them)."""
    if collate_fn is not None:
        return collate_fn(fetch(dataset, indices))
    if hasattr(dataset, "__getitems__"):
        return default_collate(fetch(dataset, indices), alloc)
    idx = indices.tolist()
    try:
        first = dataset[idx[0]]
    except Exception as err:
        raise SampleError(idx[0]) from err
    cut, seed_rest = reseed if reseed is not None else (len(idx), None)
    if sample_nbytes(first) < STREAM_MIN_BYTES:
        head = fetch(dataset, indices[1:cut])
        if seed_rest is not None:
            seed_rest()
        return default_collate([first, *head, *fetch(dataset, indices[cut:])], alloc, half)
    collator = StreamCollator(first, len(idx), alloc, half)
    put = collator.put
    put(0, first)
    del first
    for k in range(1, len(idx)):
        if k == cut and seed_rest is not None:
            seed_rest()
        i = idx[k]
        try:
            sample = dataset[i]
        except Exception as err:
            raise SampleError(i) from err
        put(k, sample)
    return collator.result()


# ---- the worker process ------------------------------------------------------------
def _seed_batch(seed: int) -> None:
    # Augmentations draw from the global RNGs; seeding them per batch from its
    # position makes them independent of which worker got the batch, and resumable.
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    # The CPU generator only: torch.manual_seed also walks every accelerator backend
    # and costs ~125 us (measured), a tenth of a tiny-sample batch.
    torch.default_generator.manual_seed(seed)


def _set_torch_worker_info(info: WorkerInfo) -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer as in a DataLoader worker.

    Map-style datasets written for DataLoader ask it, not ours: with ``None`` they took
    themselves to be in the main process (their own generator seeded alike in every
    worker). Not for a sharded dataset: the loader splits its shards, and an
    ``iterate(shard)`` over an IterableDataset that splits by worker too (webdataset's
    ``split_by_worker``, a ``islice(lines, id, None, n)``) would read only part of each
    shard, at the wrong offsets. torch keeps it in a private module global; where that
    moved, the dataset sees ``None`` as before."""
    try:
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = torch_worker.WorkerInfo(  # type: ignore[attr-defined]
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another torch
        log.debug("cannot set torch's worker info", exc_info=True)


# ---- errors from a worker ----------------------------------------------------------
def error_class(err: BaseException) -> type | None:
    """The class of ``err`` as it travels to the training process: None where the
    parent could not look it up by name (a class local to a function), or where raising
    it there would mislead (``StopIteration`` ends the loop's ``for`` without a word:
    the rest of the epoch silently lost)."""
    cls = type(err)
    if not issubclass(cls, Exception) or issubclass(cls, (StopIteration, StopAsyncIteration)):
        return None
    try:
        pickle.dumps(cls)
    except Exception:
        return None
    return cls


_MIXED: dict[type, type] = {}


def worker_error(message: str, error: type | None) -> WorkerError:
    """The error the training process raises for a worker's failure: a
    :class:`WorkerError` that is also an instance of ``error``, the class the dataset
    raised there, as DataLoader raises the worker's exception type again: an
    ``except FileNotFoundError:`` or ``pytest.raises(KeyError)`` written for DataLoader
    (or for ``num_workers=0``, where the dataset's own exception comes through) catches
    it with workers too. A plain WorkerError where no such class can be made (an
    exception whose constructor needs more than a message)."""
    if error is None or issubclass(WorkerError, error):
        return WorkerError(message)
    mixed = _MIXED.get(error)
    if mixed is None:
        try:
            # KeyError's __str__ quotes its message; the traceback must read as it does.
            mixed = type("WorkerError", (WorkerError, error),
                         {"__str__": BaseException.__str__, "__module__": WorkerError.__module__,
                          "__reduce__": _reduce_mixed})
            mixed(message)
        except Exception:
            mixed = WorkerError
        _MIXED[error] = mixed
    err = mixed(message)
    err.cause_type = error  # type: ignore[attr-defined]
    return err


def _reduce_mixed(self: WorkerError) -> tuple[Any, tuple[str, type]]:
    # The made class has no importable name: pickle (a rank's error sent to its
    # launcher, a multiprocessing pool) rebuilds it from the message and the cause's class.
    return worker_error, (str(self), self.cause_type)  # type: ignore[attr-defined]


def _worker_main(wid: int, num_workers: int, conn: Connection, dataset: Any,
                 collate_fn: Callable[[list[Any]], Any] | None, seed: int,
                 seed_batches: bool, worker_init_fn: Callable[[int], None] | None,
                 inherited: list[Connection]) -> None:
    global _WORKER_INFO
    # The process that started this worker: the training process (fork, spawn) or
    # multiprocessing's fork server (forkserver), which exits with the training process.
    # Either way the worker's parent changes once the training process is gone. (Held
    # against the training process's pid, a forkserver worker took itself for an orphan
    # at its first idle second and exited: WorkerDiedError "exited with status 0".)
    started_by = os.getppid()
    for theirs in inherited:  # the training process's socket ends (see WorkerPool._start_one)
        theirs.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's job
    torch.set_num_threads(1)  # workers share the cores with the training process
    if hasattr(os, "SCHED_BATCH"):
        # A batch-throughput job: its wake-ups do not preempt the training process,
        # which is the latency-critical one (it keeps the device fed). CPU shares are
        # unchanged. Measured on (d) of benchmarks/loader.py: about +1 point of
        # device-busy time, within run-to-run noise, never worse.
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass
    _WORKER_INFO = WorkerInfo(wid, num_workers, seed, dataset)
    if not hasattr(dataset, "shard_sizes"):
        _set_torch_worker_info(_WORKER_INFO)
    # A forked worker starts with the training process's RNG states, and torch's
    # generator is not reseeded at fork: without a seed of its own every worker drew the
    # same numbers (without per-batch seeds, all along; with them, in worker_init_fn).
    # ``seed`` is the worker's own (see WorkerPool.worker_seed), as DataLoader seeds its
    # workers; also what torch.initial_seed() says to a worker_init_fn.
    _seed_batch(seed)
    seed_halves = seed_batches and halves(dataset, collate_fn)
    slots = WorkerSlots()
    indexers: dict[int, BatchIndexer | ShardIndexer] = {}
    if worker_init_fn is not None:
        try:
            worker_init_fn(wid)
        except Exception as err:
            try:
                _post(conn, InitFailed(f"{_who()}: worker_init_fn raised:\n"
                                       + traceback.format_exc().rstrip(), error_class(err)))
            except _TrainingProcessGone:
                pass
            return
    readable = select.poll()  # Connection.poll would build a selector per message
    readable.register(conn.fileno(), select.POLLIN)
    while True:
        if not readable.poll(1000):
            if os.getppid() != started_by:
                return  # the training process is gone: exit instead of lingering
            continue
        try:
            msg = decode(conn.recv())
        except (EOFError, OSError):
            return
        if type(msg) is Task:
            try:
                _run_task(conn, msg, indexers[msg.plan_id], slots, dataset, collate_fn,
                          seed_halves, seed_batches)
            except _TrainingProcessGone:
                slots.close()
                return  # nobody to answer: exit quietly, as the training process went
        elif type(msg) is Plan:
            # Tasks of the plan before this one may still be queued: keep its indexer.
            indexers = {k: v for k, v in indexers.items() if k >= msg.plan_id - 1}
            indexers[msg.plan_id] = _indexer(msg.plan)
        elif type(msg) is MapSlot:
            try:
                fd = recv_handle(conn)
            except (EOFError, OSError):
                return  # the training process died before the slot's descriptor came
            slots.add(msg.slot_id, fd, msg.size)
        elif type(msg) is UnmapSlot:
            slots.drop(msg.slot_id)
        else:  # Stop
            slots.close()
            return


def _indexer(plan: EpochPlan | ShardPlan) -> BatchIndexer | ShardIndexer:
    """``indexer(batch) -> sample indices`` of a plan."""
    return plan.indexer()


def _run_task(conn: Connection, task: Task, indexer: BatchIndexer | ShardIndexer,
              slots: WorkerSlots, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None,
              seed_halves: bool, seed_batches: bool) -> None:
    # ``batch`` counts from the plan's start; messages name the batch by its place in
    # the epoch (plan.first_batch + batch), which differs after a resume.
    plan, seq, batch, slot_id = indexer.plan, task.seq, task.batch, task.slot_id
    try:
        indices = indexer(batch)
        prefetch_next(dataset, indexer, batch)
        cut = split_point(len(indices)) if seed_halves or task.part else 0
        if task.part:  # one half of the batch (a worker has the other one)
            indices = indices[:cut] if task.part == 1 else indices[cut:]
        # The seeds of the batch's halves (see halves()): the first half's is the
        # batch's own seed, so a batch that is not cut is seeded as it always was.
        seed = plan.batch_seed(batch, cut if task.part == 2 else 0)
        reseed = None
        if seed_batches:
            _seed_batch(seed)
            if cut and not task.part:
                reseed = (cut, partial(_seed_batch, plan.batch_seed(batch, cut)))
        out: Any = None
        if slot_id >= 0:
            arena = Arena(slots.array(slot_id))
            try:
                out = load_batch(dataset, indices, collate_fn, arena.alloc, reseed)
                _post(conn, Done(seq, slot_id, pack(out, arena)))
                return
            except SlotFull:
                pass  # too big for the slot: send it whole, the parent grows the slots
        if out is None or collate_fn is None:
            # The default collate allocates as it goes, so it starts over; reseeding
            # makes the samples fetched again identical to the first ones.
            if seed_batches:
                _seed_batch(seed)
            out = load_batch(dataset, indices, collate_fn, fresh_alloc, reseed, task.part > 0)
        _send_in_own_file(conn, seq, slot_id, out)
    except _TrainingProcessGone:
        raise
    except SampleError as err:
        cause = err.__cause__ or err
        where = (f"sample index {err.index}" if isinstance(err.index, int)
                 else f"__getitems__ for sample indices {_short(err.index)}")
        _post(conn, Failed(seq, slot_id, f"{_who()} raised {type(cause).__name__} at "
                           f"{where} (batch {plan.first_batch + batch} of epoch "
                           f"{plan.epoch}):\n"
                           + "".join(traceback.format_exception(cause)).rstrip(),
                           error_class(cause)))
    except Exception as err:
        _post(conn, Failed(seq, slot_id, f"{_who()} raised {type(err).__name__} while "
                           f"collating sample indices {_short(indexer(batch).tolist())} "
                           f"(batch {plan.first_batch + batch} of epoch {plan.epoch}):\n"
                           + traceback.format_exc().rstrip(), error_class(err)))


def _send_in_own_file(conn: Connection, seq: int, slot_id: int, out: Any) -> None:
    """Send a batch that has no slot (the first ones size the slots) in a shared file of
    its own: one copy, and only a descriptor on the socket. (The batch as bytes on the
    socket cost two more copies of it and a wake-up per 200 KiB in the training process,
    ahead of the first batch of an epoch.)"""
    size = slot_size_for(spec_nbytes(out))
    fd = create_shared_fd(size)
    try:
        mm = mmap.mmap(fd, size)
        arena = Arena(np.frombuffer(mm, dtype=np.uint8))
        spec = pack(out, arena)
        used = arena.used
        del arena  # its array exports the map: release it before closing the map
        mm.close()
        _post(conn, Oversize(seq, slot_id, spec, used))
        try:
            send_handle(conn, fd, os.getppid())
        except OSError as err:
            raise _TrainingProcessGone from err
    finally:
        os.close(fd)


class _TrainingProcessGone(Exception):
    """The worker's socket to the training process broke: that process died (SIGKILL,
    SIGTERM, the OOM killer) while the worker was loading a batch."""


def _post(conn: Connection, msg: Any) -> None:
    """Send ``msg`` to the training process. A broken socket is
    :class:`_TrainingProcessGone`, so that the worker exits without a word: reported
    as a failure of the batch, its ``BrokenPipeError`` was sent on the same broken
    socket, and each worker printed two tracebacks on the terminal of a training
    process killed mid-epoch (DataLoader's workers exit silently there)."""
    try:
        conn.send(encode(msg))
    except OSError as err:
        raise _TrainingProcessGone from err


def _who() -> str:
    info = _WORKER_INFO
    return f"loader worker {info.id if info else '?'} (pid {os.getpid()})"


def _short(items: list[int]) -> str:
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"


# ---- the training process's side ---------------------------------------------------
@dataclass
class _Worker:
    wid: int
    proc: Any  # multiprocessing.process.BaseProcess
    conn: Connection
    outstanding: set[int] = field(default_factory=set)
    slots: set[int] = field(default_factory=set)
    plans: set[int] = field(default_factory=set)
    retiring: bool = False
    readable: Any = None  # a select.poll on conn alone: Connection.poll builds a selector per call


def _map_own_file(fd: int) -> mmap.mmap:
    """The training process's map of a batch's own shared file (see _send_in_own_file):
    the batch's arrays keep it alive; the memory goes with the last of them."""
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class WorkerPool:
    """Starts, feeds, watches and stops the worker processes."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None,
                 seed: int, seed_batches: bool = True, start_method: str | None = None,
                 worker_init_fn: Callable[[int], None] | None = None,
                 per_worker: int = 2, rank: int = 0) -> None:
        if start_method is None:
            start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        try:
            self._ctx = mp.get_context(start_method)
        except ValueError:
            raise DataError(f"unknown start_method {start_method!r}; use one of "
                            f"{mp.get_all_start_methods()}") from None
        self._dataset = dataset
        self._collate_fn = collate_fn
        self._seed = seed
        self._seed_batches = seed_batches
        self._rank = rank
        # Without per-batch seeds, worker w is seeded with base + w, the base drawn here,
        # in the training process, from torch's default generator (one draw per pool, as
        # DataLoader does per iterator, and once for persistent workers): a script that
        # calls torch.manual_seed(s) gets the same augmentations in every run. (Seeded
        # from the OS, as before, they differed from run to run.)
        self.base_seed = (0 if seed_batches else
                          int(torch.empty((), dtype=torch.int64).random_().item()))
        #: Without per-batch seeds, whole tasks go to the workers in turn (see in_turn):
        #: the tasks sent so far.
        self.turn = 0
        self._init_fn = worker_init_fn
        self.per_worker = per_worker
        self.workers: list[_Worker] = []
        self._next_wid = 0
        self.target = 0
        self.closed = False
        self.owner: dict[int, _Worker] = {}  # seq -> worker
        self._poll_obj: select.poll | None = None
        self._poll_map: dict[int, _Worker] = {}
        #: Set by the loader: names the batch behind a task seq in error messages.
        self.describe: Callable[[int], str] = lambda seq: f"task {seq}"

    # ---- size ------------------------------------------------------------------------
    @property
    def active(self) -> list[_Worker]:
        return [w for w in self.workers if not w.retiring]

    def resize(self, n: int) -> None:
        """Run ``n`` workers: start new ones now, retire extra ones once idle."""
        self.target = n
        active = self.active
        for w in active[n:]:
            w.retiring = True
            self._stop_if_idle(w)
        for _ in range(n - len(active)):
            self._start_one(n)

    def _start_one(self, n: int) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        # get_worker_info().id: the lowest id no running worker holds (retiring ones
        # included), as DataLoader's ids are 0..num_workers-1; and num_workers counts it.
        # (Numbered by starts, num_workers="auto" gave ids past num_workers once it had
        # shrunk and grown, e.g. id 2 of num_workers 2.) The worker's own seed still
        # follows its start, so a worker started again on an id draws a stream of its own.
        held = {w.wid for w in self.workers}
        wid = next(i for i in range(len(held) + 1) if i not in held)
        start = self._next_wid
        self._next_wid += 1
        # A forked worker inherits the training process's ends of its own socket and of
        # the workers started before it; it closes them, so that when the training
        # process dies every worker's socket reaches end-of-file. Held open, a worker
        # killed mid-message (a slot's descriptor on its way) waited for the rest for
        # ever (1 in ~25 SIGKILLs of the training process under load).
        theirs = ([parent_conn, *(w.conn for w in self.workers)]
                  if self._ctx.get_start_method() == "fork" else [])
        proc = self._ctx.Process(  # type: ignore[attr-defined]
            target=_worker_main, name=f"ringtrain-loader-{wid}", daemon=True,
            args=(wid, max(n, wid + 1), child_conn, self._dataset, self._collate_fn,
                  self.worker_seed(start),
                  self._seed_batches, self._init_fn, theirs))
        proc.start()
        child_conn.close()  # so the worker's end lives only in the worker
        readable = select.poll()
        readable.register(parent_conn.fileno(), select.POLLIN)
        self.workers.append(_Worker(wid, proc, parent_conn, readable=readable))
        self._poll_obj = None
        log.debug("started loader worker %d (pid %d)", wid, proc.pid)

    def worker_seed(self, start: int) -> int:
        """The own seed (``get_worker_info().seed``, ``torch.initial_seed()`` when it
        starts) of the ``start``-th worker this pool starts (worker ``start`` while their
        number does not change): without per-batch seeds DataLoader's base + id; with them
        a function of (loader seed, rank, ``start``), apart for every worker of every rank
        (each batch is then seeded from its position anyway)."""
        if not self._seed_batches:
            return self.base_seed + start
        return batch_seed(self._seed, _WORKER_SEED_TAG, self._rank, start)

    def _stop_if_idle(self, w: _Worker) -> None:
        if w.retiring and not w.outstanding:
            try:
                w.conn.send(encode(Stop()))
            except OSError:
                pass

    # ---- feeding ---------------------------------------------------------------------
    def pick(self) -> _Worker | None:
        """The least busy worker that can take another task, if any."""
        best = None
        for w in self.workers:
            if not w.retiring and len(w.outstanding) < self.per_worker and (
                    best is None or len(w.outstanding) < len(best.outstanding)):
                best = w
        return best

    def in_turn(self) -> _Worker | None:
        """The worker whose turn the next task is, if it can take one (else None: wait).

        Without per-batch seeds a batch's random numbers are those of the worker's
        stream where it stands, so the batches must go to the workers in a fixed order,
        worker ``t mod n`` for the ``t``-th task as DataLoader sends them, for a run to
        repeat; the least busy worker (pick) depends on timing.
        """
        active = self.active
        if not active:
            return None
        w = active[self.turn % len(active)]
        return w if len(w.outstanding) < self.per_worker else None

    def submit(self, w: _Worker, seq: int, plan_id: int, plan: EpochPlan | ShardPlan, batch: int,
               slot: Slot | None, part: int = 0) -> None:
        """Send ``w`` the task ``seq`` (for part 2 of a split batch: ``~seq``)."""
        try:
            if plan_id not in w.plans:
                w.conn.send(encode(Plan(plan_id, plan)))
                w.plans.add(plan_id)
            if slot is not None and slot.id not in w.slots:
                w.conn.send(encode(MapSlot(slot.id, slot.size)))
                send_handle(w.conn, slot.fd, w.proc.pid)
                w.slots.add(slot.id)
            w.conn.send(encode(Task(seq, plan_id, batch, -1 if slot is None else slot.id, part)))
        except OSError:
            self._raise_died(w, seq)
        w.outstanding.add(seq)
        self.owner[seq] = w
        self.turn += 1

    def forget_slots(self, slot_ids: list[int]) -> None:
        """Tell workers to unmap retired slots (their memory is freed with the last map)."""
        for w in self.workers:
            for sid in slot_ids:
                if sid in w.slots:
                    w.slots.discard(sid)
                    try:
                        w.conn.send(encode(UnmapSlot(sid)))
                    except OSError:
                        pass

    # ---- results ---------------------------------------------------------------------
    def _poller(self) -> select.poll:
        # One poll object kept across calls: multiprocessing.connection.wait builds a
        # selector per call, which cost more than the rest of the parent's per-batch work.
        if self._poll_obj is None:
            self._poll_obj = select.poll()
            self._poll_map = {}
            for w in self.workers:
                for fd in (w.conn.fileno(), w.proc.sentinel):
                    self._poll_obj.register(fd, select.POLLIN)
                    self._poll_map[fd] = w
        return self._poll_obj

    def poll(self, timeout: float | None) -> list[Done | Oversize | Failed]:
        """Answers from the workers within ``timeout`` s; raises if one died (or its
        ``worker_init_fn`` failed)."""
        poller = self._poller()
        events = poller.poll(None if timeout is None else int(timeout * 1000))
        out: list[Done | Oversize | Failed] = []
        exited = []
        for fd, _ in events:
            w = self._poll_map.get(fd)
            if w is None:
                continue
            if fd == w.proc.sentinel:
                exited.append(w)
            else:
                self._drain(w, out)
        for w in exited:
            if w in self.workers:
                self._drain(w, out)
                self._exited(w)
        return out

    def _drain(self, w: _Worker, out: list[Done | Oversize | Failed]) -> None:
        try:
            while w.readable.poll(0):
                msg = cast("Done | Oversize | Failed | InitFailed", decode(w.conn.recv()))
                if type(msg) is InitFailed:
                    raise worker_error(msg.message, msg.error)
                if type(msg) is Oversize:
                    msg = msg._replace(payload=_map_own_file(recv_handle(w.conn)))
                msg = cast("Done | Oversize | Failed", msg)
                w.outstanding.discard(msg.seq)
                self.owner.pop(msg.seq, None)
                out.append(msg)
        except (EOFError, OSError):
            pass  # the sentinel reports the death
        self._stop_if_idle(w)

    def _exited(self, w: _Worker) -> None:
        w.proc.join(timeout=1.0)
        if w.retiring and not w.outstanding:
            self.workers.remove(w)
            self._poll_obj = None
            w.conn.close()
            return
        self._raise_died(w, min(w.outstanding) if w.outstanding else None)

    def _raise_died(self, w: _Worker, seq: int | None) -> None:
        code = w.proc.exitcode
        if code is None:
            how = "stopped answering"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        raise WorkerDiedError(
            f"loader worker {w.wid} (pid {w.proc.pid}) {how}"
            + ("" if seq is None else f" while loading {self.describe(seq)}")
            + "; if it ran out of memory (see `dmesg`), lower num_workers, batch_size "
            "or prefetch")

    # ---- shutdown --------------------------------------------------------------------
    def close(self, timeout: float = 2.0) -> None:
        """Stop every worker: ask, then terminate, then kill; never hangs."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            try:
                w.conn.send(encode(Stop()))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
        stop_sequence([SpawnedProcess(w.proc) for w in self.workers], grace=1.0)
        for w in self.workers:
            w.conn.close()
        self.workers.clear()
        self.owner.clear()

