"""The training process's side of the worker pipeline: batches of one epoch, in order.

:class:`WorkerFeed` keeps the workers busy (a task per free slot and idle worker, up
to ``prefetch`` batches ahead of the loop), collects their answers, delivers them in
order, and turns each into a batch:

* zero-copy: numpy/torch views of the slot, built on a fresh numpy object per batch;
  a weak reference on that object returns the slot once the loop has dropped every
  tensor of the batch (so a batch the loop keeps is never overwritten);
* copied out: once the loop holds ``keep`` zero-copy batches, later batches are copied
  (one ``memcpy``) and their slot goes straight back, so workers never starve;
* for the device stager: views plus a ``release`` callback it runs after the copy event.

Everything that must be released at exit lives here, apart from the loader, so a
``weakref.finalize`` on the loader can clean up without keeping it alive.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ringtrain.data.ahead import Helper
from ringtrain.data.collate import join_halves, unpack
from ringtrain.data.order import EpochPlan, ShardPlan
from ringtrain.data.prefetch import DeviceStager
from ringtrain.data.protocol import Done, Failed, Oversize
from ringtrain.data.shm import Slot, SlotPool
from ringtrain.data.window import DispatchWindow
from ringtrain.data.workers import WorkerPool, halves, split_point, worker_error
from ringtrain.errors import DataError, LoaderTimeoutError

__all__ = ["WorkerFeed"]

log = logging.getLogger("ringtrain.data")

#: A worker's answer to a task, as the feed keeps it until the loop takes the batch.
Answer = Done | Oversize | Failed

# Per-worker queue depth when a batch is at most this big (see WorkerFeed.prefetch).
_SMALL_BATCH = 8 << 20

# Batches the helper thread wraps ahead of the loop (CPU delivery): two absorb a step
# in which no worker happened to answer, one more would only hold another slot.
_AHEAD = 2
# The helper only runs while the loop spends at least this long between batches: below
# it there is no step to hide the work behind (see ringtrain.data.ahead).
_HELPER_MIN_STEP_S = 0.001


class WorkerFeed:
    """Worker pool, shared-memory slots and the in-order delivery of their batches."""

    def __init__(self, dataset: Any, worker_kwargs: dict[str, Any], *, keep: int,
                 zero_copy: bool, prefetch: int | None, stager: DeviceStager | None,
                 pin: bool, device_depth: int) -> None:
        self._dataset = dataset
        self._worker_kwargs = worker_kwargs
        self._keep, self._zero_copy, self._prefetch_arg = keep, zero_copy, prefetch
        self.stager, self._pin, self._device_depth = stager, pin, device_depth
        self.pool: WorkerPool | None = None
        self.slots: SlotPool | None = None
        self.refs: dict[int, tuple[weakref.ref, int]] = {}  # zero-copy batches the loop holds
        # Their references once the loop let go; the slots are released by reclaim().
        self._dropped: deque[weakref.ref] = deque()
        self.num_workers = 0
        self.describe: Callable[[int], str] = lambda k: f"batch {k}"
        self.copied_batches = 0
        self.fallback_batches = 0
        self.ahead_batches = 0  # batches the helper thread had wrapped before the loop asked
        # Which batches go out next, under which seqs (see ringtrain.data.window).
        self._window = DispatchWindow()
        self._ready: dict[int, Answer] = {}  # seq -> answer, until the loop takes it
        # A loader that has just started splits the batch the loop waits for between
        # two workers (see _split_first): seq -> the halves in so far, by part.
        self._halves = halves(dataset, worker_kwargs.get("collate_fn"))
        # Without per-batch seeds each batch draws from its worker's stream: the tasks
        # go to the workers in turn and the first batch is not split (its halves would
        # draw from two streams), so a run repeats under torch.manual_seed.
        self._in_turn = not worker_kwargs.get("seed_batches", True)
        self._halves = self._halves and not self._in_turn
        self._split: dict[int, dict[int, Oversize]] = {}
        # CPU delivery: batches wrapped ahead by the helper thread, (batch index, batch).
        # Every use of the feed's state from here on holds _lock (see ringtrain.data.ahead).
        self._lock = threading.Lock()
        self._built: deque[tuple[int, Any]] = deque()
        self._build_k = 0  # the batch of the plan the helper wraps next
        self._helper = Helper(self._lock, self._helper_fds, self._help)

    # ---- sizes -------------------------------------------------------------------------
    @property
    def prefetch(self) -> int:
        """Batches loaded ahead of the loop: 4 per worker while batches are small (one
        slow batch stalls in-order delivery of short tasks more often), else 2."""
        if self._prefetch_arg:
            return self._prefetch_arg
        small = self.slots is not None and 0 < self.slots.slot_bytes <= _SMALL_BATCH
        return max(2, (4 if small else 2) * self.num_workers)

    @property
    def slot_count(self) -> int:
        """Shared-memory slots that exist now: at most ``prefetch + keep + 1``, plus
        ``device_prefetch`` on CUDA."""
        return 0 if self.slots is None else len(self.slots.slots)

    @property
    def slot_bytes(self) -> int:
        """The size of a slot (0 before the first batch sized them)."""
        return 0 if self.slots is None else self.slots.slot_bytes

    @property
    def pinned_slots(self) -> int:
        """Slots page-locked for the device copy (CUDA)."""
        return 0 if self.slots is None else sum(s.pinned for s in self.slots.slots.values())

    def _max_slots(self) -> int:
        return self.prefetch + self._keep + self._device_depth + 1

    def _resize_queues(self) -> None:
        if self.pool is not None and self.slots is not None:
            # One more than its share of the window, so a worker can be topped up two
            # tasks at a time while it still has one to work on (see _dispatch).
            self.pool.per_worker = max(2, -(-self.prefetch // max(1, self.num_workers))) + 1
            self.slots.set_max_slots(self._max_slots())

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, num_workers: int) -> None:
        """Make sure ``num_workers`` workers run (after a failure: fresh ones)."""
        # No helper thread while worker processes are forked: a fork copies only the
        # forking thread, and locks another thread holds would stay locked in the child.
        self._helper.stop()
        with self._lock:
            self._start(num_workers)

    def _start(self, num_workers: int) -> None:
        self.num_workers = num_workers
        if self.pool is not None and not self.pool.closed:
            self.pool.resize(num_workers)
            self._resize_queues()
            return
        self.pool = WorkerPool(self._dataset, **self._worker_kwargs)
        self.pool.describe = lambda seq: self.describe(
            self._window.batch_of(seq if seq >= 0 else ~seq))  # ~seq: half 2 of a split batch
        self.slots = SlotPool(self._max_slots(), on_create=self._slot_created,
                              on_retire=self._slot_retired)
        self.refs.clear()
        self._dropped.clear()
        self.pool.resize(num_workers)
        self._resize_queues()

    def begin(self, plan: EpochPlan | ShardPlan,
              next_plan: EpochPlan | ShardPlan | None = None) -> None:
        """Deliver ``plan``'s batches from now on; ``next_plan`` is the likely next epoch.

        Batches of ``next_plan`` are loaded once every batch of ``plan`` has been
        handed to a worker, so a new epoch starts with full queues instead of waiting
        for its first batch (DataLoader's workers idle there, even persistent ones).
        If the next epoch turns out different (``set_epoch`` to another epoch, a
        resume), those batches are dropped.
        """
        with self._lock:
            self._begin(plan, next_plan)

    def _begin(self, plan: EpochPlan | ShardPlan, next_plan: EpochPlan | ShardPlan | None) -> None:
        if self._window.begin(plan, next_plan):
            self._drop_ready(self._window.is_stale)  # adopted: drop what is left over
        else:
            self._drop_ready(lambda seq: True)
        self._built.clear()
        self._build_k = 0

    def _drop_ready(self, stale: Callable[[int], bool]) -> None:
        for seq in [seq for seq in self._split if stale(seq)]:
            del self._split[seq]  # halves still to come are dropped on arrival
        for seq in [seq for seq in self._ready if stale(seq)]:
            msg = self._ready.pop(seq)
            if type(msg) is Done and self.slots is not None:
                self.slots.release(msg.slot_id)
        if self.stager is not None:
            self.stager.clear()  # staged batches belong to the plan that ended

    def abandon(self) -> None:
        """Forget undelivered batches; results still in flight are dropped on arrival."""
        with self._lock:
            self._abandon()

    def _abandon(self) -> None:
        self._built.clear()
        self._drop_ready(lambda seq: True)
        self._window.abandon()  # everything dispatched so far is stale now

    def fail(self) -> None:
        """After an error or Ctrl-C: stop the workers at once, nothing left behind."""
        self._helper.stop()  # first, and without the lock: the helper may be waiting for it
        self._built.clear()
        self._ready.clear()
        self._split.clear()
        self._window.abandon()
        if self.pool is not None:
            self.pool.close(timeout=0.5)  # a worker stuck in the dataset is terminated soon
        if self.stager is not None:
            try:
                self.stager.clear()
            except Exception:  # a broken CUDA context must not stop the cleanup
                log.debug("stager cleanup failed", exc_info=True)
        if self.slots is not None:
            self.slots.close()
            self.slots = None

    def close(self) -> None:
        """Stop the workers and free the slots (the loader's finalizer)."""
        self._helper.stop()
        self._built.clear()
        self._ready.clear()
        self._split.clear()
        # Everything sent so far went to workers that are stopped now: a loader
        # iterated again after close() must not adopt the next epoch's batches those
        # workers had been given (it waited for answers that never come and raised
        # "cannot schedule batch 0 ... this is a bug").
        self._window.abandon()
        if self.stager is not None:
            try:
                self.stager.clear()
            except Exception:
                log.debug("stager cleanup failed", exc_info=True)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.slots is not None:
            self.slots.close()
            self.slots = None

    # ---- slots and the device ---------------------------------------------------------
    def _slot_created(self, slot: Slot) -> None:
        if self._pin and self.stager is not None:
            slot.pinned = self.stager.backend.register(slot.address, slot.size)

    def _slot_retired(self, slot: Slot) -> None:
        if slot.pinned and self.stager is not None:
            slot.pinned = False
            try:
                self.stager.backend.unregister(slot.address)
            except Exception:  # at interpreter exit the CUDA context may be gone already
                log.debug("could not unregister slot %d", slot.id, exc_info=True)

    def reclaim(self) -> None:
        """Release the slots of the zero-copy batches the loop has let go of.

        The weak references' callback is ``deque.append``, which runs no Python code:
        a Python callback runs wherever the loop drops its last view of a batch, and a
        Ctrl-C that arrives then raises KeyboardInterrupt inside the callback, where
        Python prints "Exception ignored" and drops it (the training process went on
        as if it was never pressed, 1 run in ~350 under load)."""
        dropped = self._dropped
        while dropped:
            try:
                ref = dropped.popleft()
            except IndexError:  # another thread took the last one
                return
            entry = self.refs.pop(id(ref), None)
            if entry is not None and self.slots is not None:
                self.slots.release(entry[1])

    @property
    def held_batches(self) -> int:
        """Zero-copy batches the loop still holds."""
        self.reclaim()
        return len(self.refs)

    # ---- delivery ----------------------------------------------------------------------
    def peek(self, k: int) -> Answer | None:
        """Batch ``k``'s answer if it has arrived (without waiting)."""
        return self._ready.get(self._window.seq(k))

    def take(self, k: int, timeout: float | None) -> Answer:
        """Wait for batch ``k``'s answer, dispatching work meanwhile."""
        pool = self.pool
        assert pool is not None
        seq = self._window.seq(k)
        self._window.taking(k)
        deadline = None if timeout is None else time.monotonic() + timeout
        while seq not in self._ready:
            self._dispatch()
            if seq not in pool.owner and ~seq not in pool.owner and seq not in self._ready:
                # Not even dispatched: every slot is busy; finished copies free some.
                if self.stager is not None and self.stager.copying:
                    self.stager.reap(block=True)
                    continue
                if not pool.owner:  # and nothing in flight: waiting would hang
                    raise DataError(
                        f"the loader cannot schedule batch {k}: no free slot or worker "
                        f"({self.held_batches} batches held by the loop, {len(pool.active)} "
                        "workers); this is a bug, please report it")
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            for msg in pool.poll(wait):
                self._accept(msg)
            if deadline is not None and seq not in self._ready and time.monotonic() >= deadline:
                raise LoaderTimeoutError(
                    f"no batch from the {len(pool.workers)} loader workers in {timeout:g} s "
                    f"({self.describe(k)}); a dataset call may be hanging, or raise "
                    "Loader(timeout=...)")
        msg = self._ready.pop(seq)
        self._window.took(k)
        # Refill before the loop computes on this batch, but make at most one new slot
        # here: right after the first batches sized the slots, making the window's worth
        # (reserving and zeroing ~16 MiB each for 3x64x64 float batches of 256) held
        # back the first batch by 10-30 ms; the helper thread makes the rest while the
        # loop computes. For the very first batch not even one: that one slot held it
        # back by ~10 ms (measured, aug batches of 12.6 MB), and the workers wait for the
        # helper's slots no longer than for this one.
        assert self.slots is not None
        self._dispatch(new_slots=1 if self.slots.slots else 0)
        return msg

    def next_batch(self, k: int, timeout: float | None, loop_s: float | None = None) -> Any:
        """Batch ``k`` of the plan for a loop on the CPU: wrapped ahead by the helper
        thread when it was ready in time, else received and wrapped here. ``loop_s``:
        how long the loop spent since the previous batch (None: unknown)."""
        with self._lock:
            if self._helper.error is not None:
                raise self._helper.error
            if self._built and self._built[0][0] == k:
                batch = self._built.popleft()[1]
                self.ahead_batches += 1
            else:
                self._built.clear()
                batch = self.host_batch(self.take(k, timeout), device=False)[0]
                self._build_k = k + 1
        if loop_s is not None and loop_s < _HELPER_MIN_STEP_S:
            self._helper.park()
        else:
            self._helper.start()
        return batch

    def _helper_fds(self) -> list[int]:
        pool = self.pool
        if pool is None or pool.closed:
            return []
        return [fd for w in pool.workers for fd in (w.conn.fileno(), w.proc.sentinel)]

    def _help(self) -> None:
        """On the helper thread, under the lock: take what the workers sent, refill them,
        wrap the next batches if they are in. Errors are left for the loop to raise."""
        pool, window = self.pool, self._window
        plan = window.plan
        if pool is None or pool.closed or plan is None or self.slots is None:
            return
        for msg in pool.poll(0):
            self._accept(msg)
        while len(self._built) < _AHEAD and self._build_k < plan.num_batches:
            k = self._build_k
            answer = self._ready.get(window.seq(k))
            if answer is None or type(answer) is Failed:
                break
            del self._ready[window.seq(k)]
            window.took(k)
            self._built.append((k, self.host_batch(answer, device=False)[0]))
            self._build_k = k + 1
        self._dispatch()

    def _dispatch(self, new_slots: int | None = None) -> None:
        """Hand out tasks while there are batches to do, free slots and idle workers;
        ``new_slots``: at most that many slots are made for them (None: as many as fit)."""
        self.reclaim()
        pool, slots, window = self.pool, self.slots, self._window
        assert pool is not None and slots is not None and window.plan is not None
        if self.stager is not None:
            self.stager.reap()
        prefetch = self.prefetch
        if self._halves and not slots.sized and not pool.owner:
            self._split_first(prefetch)
        while True:
            worker = pool.in_turn() if self._in_turn else pool.pick()
            if worker is None:
                break
            room = 1 if self._in_turn else min(prefetch - window.out,
                                               pool.per_worker - len(worker.outstanding))
            if room < 2 and worker.outstanding and window.left >= 2 and not self._in_turn:
                # Every worker has work queued. Waking an idle worker costs a context
                # switch (~0.1 ms measured in a VM, 1% of a 10 ms step): send two tasks
                # per wake-up instead of one.
                break
            sent = 0
            while sent < max(1, room):
                task = window.next_task(prefetch)
                if task is None:
                    break
                made = slots.created
                slot = slots.acquire(create=new_slots is None or new_slots > 0)
                if slot is None and (slots.sized or worker.outstanding
                                     or len(pool.owner) >= len(pool.active)):
                    # All slots busy; or not sized yet: one batch per worker sizes them,
                    # each to its own worker (two to the first one left the second
                    # idle until the first batch was in).
                    break
                # Counted by creations: acquire may retire a slot too small and make
                # its replacement, which leaves the number of slots unchanged.
                if new_slots is not None and slots.created > made:
                    new_slots -= 1
                pool.submit(worker, task.seq, task.plan_id, task.plan, task.batch, slot)
                window.sent(task)
                sent += 1
            if sent == 0:
                break
        if slots.retired:
            pool.forget_slots(slots.retired)
            slots.retired.clear()

    def _split_first(self, prefetch: int) -> None:
        """A loader that has just started (no slots sized, nothing in flight): the batch
        the loop waits for goes to two idle workers, a half each, so it is in after half
        a batch's loading (see ``workers.halves``: each half is seeded from its own
        position, so the batch is the one a single worker would load). Later batches
        go whole: by then the workers are ahead of the loop."""
        pool, window = self.pool, self._window
        assert pool is not None
        idle = [w for w in pool.active if not w.outstanding]
        task = window.next_task(prefetch)
        if (len(idle) < 2 or task is None
                or not split_point(task.plan.batch_len(task.batch))):
            return
        for worker, key, part in ((idle[0], task.seq, 1), (idle[1], ~task.seq, 2)):
            pool.submit(worker, key, task.plan_id, task.plan, task.batch, None, part)
        window.sent(task)
        self._split[task.seq] = {}

    def _join(self, msg: Answer) -> Answer | None:
        """A half of a split batch (key ``seq``: part 1, ``~seq``: part 2): the whole
        batch once both are in, else None. A failed half fails the batch."""
        seq, part = (~msg.seq, 2) if msg.seq < 0 else (msg.seq, 1)
        got = self._split.get(seq)
        if got is None:
            return None  # dropped (a new plan), or the other half failed already
        if type(msg) is not Oversize:
            del self._split[seq]
            return msg._replace(seq=seq)
        got[part] = msg
        if len(got) < 2:
            return None
        del self._split[seq]
        first, second = got[1], got[2]
        try:
            spec, buf = join_halves(first.spec, np.frombuffer(first.payload, dtype=np.uint8),
                                    second.spec, np.frombuffer(second.payload, dtype=np.uint8))
        except DataError as err:
            return Failed(seq, -1, f"the halves of {self.describe(self._window.batch_of(seq))}"
                                   f" loaded by two workers do not make one batch: {err}")
        return Oversize(seq, -1, spec, buf.nbytes, buf)

    def _accept(self, msg: Answer) -> None:
        slots = self.slots
        assert slots is not None
        if msg.seq < 0 or msg.seq in self._split:
            joined = self._join(msg)
            if joined is None:
                return
            msg = joined
        if type(msg) is Oversize:
            self.fallback_batches += 1
            slots.fit(msg.nbytes, headroom=0.25 if msg.slot_id >= 0 else 0.0)
            self._resize_queues()
        if type(msg) is not Done and msg.slot_id >= 0:
            slots.release(msg.slot_id)  # the batch is not in its slot: the slot is free
        if self._window.is_stale(msg.seq):  # left over from an abandoned epoch
            if type(msg) is Done:
                slots.release(msg.slot_id)
            return
        self._ready[msg.seq] = msg

    def host_batch(self, msg: Answer, device: bool
                   ) -> tuple[Any, bool, Callable[[], None] | None]:
        """A worker's answer as a host batch: (batch, page-locked?, release callback)."""
        if type(msg) is Failed:
            raise worker_error(msg.message, msg.error)
        if type(msg) is Oversize:
            assert msg.payload is not None
            return unpack(msg.spec, np.frombuffer(msg.payload, dtype=np.uint8)), False, None
        slots = self.slots
        assert type(msg) is Done and slots is not None
        slot = slots.slots[msg.slot_id]
        raw = slot.fresh_array()
        if device:  # the stager copies it, then releases the slot after the copy event
            return unpack(msg.spec, raw), slot.pinned, partial(slots.release, slot.id)
        # Batches wrapped ahead are not held by the loop (yet): they do not count.
        if not self._zero_copy or self.held_batches - len(self._built) >= self._keep:
            batch = unpack(msg.spec, raw, copy=True)
            slots.release(slot.id)
            self.copied_batches += 1
            return batch, False, None
        batch = unpack(msg.spec, raw)
        ref = weakref.ref(raw, self._dropped.append)
        self.refs[id(ref)] = (ref, slot.id)
        return batch, False, None
