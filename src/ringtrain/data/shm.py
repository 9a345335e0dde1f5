"""Reusable shared-memory slots that loader workers write batches into.

Each slot is an anonymous shared file (``memfd_create`` on Linux, else an unlinked
temporary file) mapped once in the training process and once in each worker that
uses it. Workers build a batch in place and report only the slot id; the slot is
reused batch after batch, so pages are faulted in once, not per batch, and no
segment is created, named, passed or unlinked per batch (the costs measured in
pytorch/pytorch#24984 and #973).

Why anonymous files: nothing ever appears under ``/dev/shm``, so no crash, ``kill -9``
or Ctrl-C can leave a segment behind (the kernel frees the memory when the last
process holding it exits), and Docker's default 64 MiB ``/dev/shm`` limit does not
apply. Workers receive a slot's descriptor once, over their control socket.

Slots are sized from the first batch; a later batch that does not fit makes the
pool raise its target size, and smaller slots are replaced as they come back.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable

import numpy as np

from ringtrain.errors import DataError

__all__ = ["Slot", "SlotPool", "WorkerSlots", "create_shared_fd", "slot_size_for"]

_PAGE = mmap.PAGESIZE


def slot_size_for(nbytes: int, headroom: float = 0.0) -> int:
    """Bytes for a slot holding ``nbytes`` (plus ``headroom``), rounded up to pages."""
    want = int(nbytes * (1.0 + headroom)) + 64 * 16  # room for per-field alignment
    return max(_PAGE, -(-want // _PAGE) * _PAGE)


def create_shared_fd(size: int) -> int:
    """A descriptor of ``size`` bytes of shareable memory that has no name on disk."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("ringtrain-slot", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="ringtrain-slot-", dir=directory)
        os.unlink(path)  # anonymous from here on: freed with the last descriptor/mapping
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            # Reserve the memory now: a full tmpfs or memory limit becomes this clear
            # error instead of a SIGBUS in a worker halfway through a batch.
            os.posix_fallocate(fd, 0, size)
    except OSError as err:
        os.close(fd)
        raise DataError(
            f"cannot reserve {size / 2**20:.1f} MiB of shared memory for a batch slot ({err}); "
            "lower batch_size or prefetch, or raise the container's memory limit"
        ) from None
    return fd


class Slot:
    """One slot as the training process sees it."""

    __slots__ = ("id", "size", "fd", "mm", "_view", "pinned")

    def __init__(self, slot_id: int, size: int) -> None:
        self.id = slot_id
        self.size = size
        self.fd = create_shared_fd(size)
        self.mm = mmap.mmap(self.fd, size)
        self._view = memoryview(self.mm)
        self.pinned = False  # set by the device stager after cudaHostRegister

    @property
    def address(self) -> int:
        return int(np.frombuffer(self._view, dtype=np.uint8, count=1).ctypes.data)

    def fresh_array(self) -> np.ndarray:
        """A new uint8 array over the slot, made per batch.

        Its base is a memoryview, not an ndarray, so numpy does not collapse views of
        it past it: every field of the batch (and every tensor made from them) keeps
        *this* object alive, and a weak reference to it says when the user has let
        go of the whole batch.
        """
        return np.frombuffer(self._view, dtype=np.uint8)

    def close(self) -> None:
        try:
            self._view.release()
            self.mm.close()
        except BufferError:
            pass  # a batch the user still holds maps it; it is unmapped when that dies
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotPool:
    """The training process's slots: at most ``max_slots``, created on demand."""

    def __init__(self, max_slots: int,
                 on_create: Callable[[Slot], None] | None = None,
                 on_retire: Callable[[Slot], None] | None = None) -> None:
        if max_slots < 1:
            raise DataError(f"need at least one shared-memory slot, got {max_slots}")
        self.max_slots = max_slots
        self.slot_bytes = 0  # 0: not sized yet (the first batch sizes it)
        self.slots: dict[int, Slot] = {}
        self._free: list[int] = []
        self._next_id = 0
        self.created = 0  # slots made so far (retiring one does not lower it)
        self._on_create = on_create
        self._on_retire = on_retire
        self.retired: list[int] = []  # ids workers should unmap (drained by the pool)
        self.closed = False

    @property
    def sized(self) -> bool:
        return self.slot_bytes > 0

    @property
    def free_count(self) -> int:
        return len(self._free) + (self.max_slots - len(self.slots))

    def fit(self, nbytes: int, headroom: float) -> None:
        """Make future slots hold ``nbytes``; smaller slots are replaced when freed."""
        if nbytes > self.slot_bytes:
            self.slot_bytes = slot_size_for(nbytes, headroom)

    def acquire(self, create: bool = True) -> Slot | None:
        """A free slot of the current size, or ``None`` when all are in use (or, with
        ``create=False``, when none is free without making a new one)."""
        while self._free:
            slot = self.slots[self._free.pop()]
            if slot.size >= self.slot_bytes:
                return slot
            self._retire(slot)  # too small for the batches we now see
        if create and len(self.slots) < self.max_slots and self.sized:
            slot = Slot(self._next_id, self.slot_bytes)
            self._next_id += 1
            self.created += 1
            self.slots[slot.id] = slot
            if self._on_create is not None:
                self._on_create(slot)
            return slot
        return None

    def release(self, slot_id: int) -> None:
        """Give a slot back (safe after close and for unknown ids)."""
        if not self.closed and slot_id in self.slots:
            self._free.append(slot_id)

    def _retire(self, slot: Slot) -> None:
        del self.slots[slot.id]
        self.retired.append(slot.id)
        if self._on_retire is not None:
            self._on_retire(slot)
        slot.close()

    def set_max_slots(self, n: int) -> None:
        self.max_slots = max(1, n)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for slot in list(self.slots.values()):
            if self._on_retire is not None:
                self._on_retire(slot)
            slot.close()
        self.slots.clear()
        self._free.clear()


class WorkerSlots:
    """The slots as one worker sees them: id -> writable uint8 array."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}

    def add(self, slot_id: int, fd: int, size: int) -> None:
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the memory; the descriptor is not needed
        self._maps[slot_id] = (mm, np.frombuffer(mm, dtype=np.uint8))

    def array(self, slot_id: int) -> np.ndarray:
        return self._maps[slot_id][1]

    def drop(self, slot_id: int) -> None:
        entry = self._maps.pop(slot_id, None)
        if entry is None:
            return
        mm, arr = entry
        del arr, entry
        try:
            mm.close()
        except BufferError:
            pass  # still referenced by a batch being built; freed with it

    def close(self) -> None:
        for slot_id in list(self._maps):
            self.drop(slot_id)
