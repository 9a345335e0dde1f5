"""Copy batches to the GPU ahead of the training loop, overlapping compute.

Only used when the loader's device is CUDA; everything else in the loader runs (and
is tested) without a GPU. The mechanics:

* Page-locking happens once per shared-memory slot (``cudaHostRegister``), not per
  batch, so ``non_blocking=True`` copies are real DMA straight out of the slot and no
  pin-memory thread is needed (that thread's GIL contention is pytorch/pytorch#77139).
* Copies are issued on a side stream ``depth`` batches ahead, bracketed by events.
  Handing a batch over makes the *current* stream wait on its copy event (a GPU-side
  wait; the host does not block) and calls ``record_stream`` so the caching allocator
  does not reuse the memory while compute still reads it.
* A slot goes back to the workers only after its copy event has completed, so a
  non-blocking copy never reads a slot that is being refilled.

The CUDA calls sit behind a tiny backend object so the ordering logic is unit-tested
on the CPU with a fake backend.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableSequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ringtrain import events
from ringtrain.data.collate import mapping_like, sequence_like

__all__ = ["DeviceStager", "CudaBackend", "StagerBackend", "tree_map"]

log = logging.getLogger("ringtrain.data")


def tree_map(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor of a batch; ndarrays are copied, others kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, np.ndarray):
        return batch.copy()  # it may view a slot that is about to be reused
    if type(batch) is dict:
        return {k: tree_map(fn, v) for k, v in batch.items()}
    if type(batch) is list:
        return [tree_map(fn, v) for v in batch]
    if isinstance(batch, tuple):
        items = [tree_map(fn, v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, Mapping):  # keeps its type (an OrderedDict batch stays one)
        return mapping_like(batch, {k: tree_map(fn, v) for k, v in batch.items()})
    if isinstance(batch, MutableSequence):
        return sequence_like(batch, [tree_map(fn, v) for v in batch])
    return batch


def _tensors(batch: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(lambda t: out.append(t), batch)
    return out


class StagerBackend(Protocol):
    """What the stager needs from a device runtime (CUDA, or a fake in tests)."""

    def register(self, ptr: int, size: int) -> bool: ...
    def unregister(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int) -> np.ndarray: ...
    def copy(self, host: Any, non_blocking: bool) -> tuple[Any, Any, Any]: ...
    def run(self, fn: Callable[[Any, Any], Any], host: Any) -> tuple[Any, Any, Any]: ...
    def done(self, event: Any) -> bool: ...
    def wait(self, event: Any) -> None: ...
    def hand_over(self, batch: Any, event: Any) -> None: ...
    def elapsed_s(self, start: Any, end: Any) -> float: ...


class CudaBackend:
    """The real thing: a side stream, timing events, cudaHostRegister."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def register(self, ptr: int, size: int) -> bool:
        # flags=0 (cudaHostRegisterDefault: mapped and portable under UVA). Under the
        # loader's device: the runtime call runs in the current device's context, and a
        # loader on cuda:N in a process that never called set_device(N) made (and held
        # memory for) a context on GPU 0, in every rank.
        with torch.cuda.device(self.device):
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
        if err != 0:
            log.warning("could not page-lock a %.1f MiB batch slot (cudaError %d); host-to-"
                        "device copies of its batches will be synchronous (raise "
                        "`ulimit -l` or lower prefetch)", size / 2**20, err)
        return err == 0

    def unregister(self, ptr: int) -> None:
        with torch.cuda.device(self.device):
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def host_alloc(self, nbytes: int) -> np.ndarray:
        # Page-locked memory from torch's caching host allocator (num_workers=0): it
        # records an event on each non_blocking copy and recycles a block only after it.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    def copy(self, host: Any, non_blocking: bool) -> tuple[Any, Any, Any]:
        return self._between_events(
            lambda: tree_map(lambda t: t.to(self.device, non_blocking=non_blocking), host))

    def run(self, fn: Callable[[Any, Any], Any], host: Any) -> tuple[Any, Any, Any]:
        """``fn(host, device)`` on the side stream between two events (a device stage
        such as GPU decode, which reads the host batch itself)."""
        return self._between_events(lambda: fn(host, self.device))

    def _between_events(self, work: Callable[[], Any]) -> tuple[Any, Any, Any]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start.record(self.stream)
            try:
                dev = work()
            except BaseException:
                # No end event, so the stager never tracks this batch: copies already
                # queued still read its host memory (a slot that the failing loader
                # unregisters and unmaps next). Let them finish first.
                with contextlib.suppress(Exception):  # a broken context: the error stands
                    self.stream.synchronize()
                raise
            end.record(self.stream)
        return dev, start, end

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def wait(self, event: Any) -> None:
        event.synchronize()

    def hand_over(self, batch: Any, event: Any) -> None:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)  # GPU-side: compute starts after the copy, host runs on
        for t in _tensors(batch):
            if t.device.type == "cuda":
                t.record_stream(current)  # memory was allocated on the side stream

    def elapsed_s(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3


@dataclass
class _Staged:
    batch: Any
    start: Any
    end: Any
    release: Callable[[], None] | None
    host: Any  # keeps the host views alive until the copy is done
    issued_at: float = 0.0  # host clock when the copy was queued (for the timeline)


class DeviceStager:
    """Batches copied (or being copied) to the device, oldest first."""

    def __init__(self, backend: StagerBackend,
                 on_device: Callable[[Any, Any], Any] | None = None) -> None:
        self.backend = backend
        #: ``fn(host batch, device) -> device batch`` run on the side stream instead of
        #: a plain copy (a collate_fn's ``on_device`` stage, e.g. GPU decode).
        self.on_device = on_device
        self._ready: deque[_Staged] = deque()  # staged, not handed out yet
        self._copying: deque[_Staged] = deque()  # host memory not released yet
        self.last_h2d_s = 0.0
        self.total_h2d_s = 0.0

    def __len__(self) -> int:
        return len(self._ready)

    def stage(self, host: Any, pinned: bool, release: Callable[[], None] | None) -> None:
        """Start copying ``host`` to the device; ``release`` runs once it is copied."""
        if self.on_device is not None:
            dev, start, end = self.backend.run(self.on_device, host)
        else:
            dev, start, end = self.backend.copy(host, non_blocking=pinned)
        st = _Staged(dev, start, end, release, host, time.perf_counter())
        self._ready.append(st)
        self._copying.append(st)
        self.reap()

    def pop(self) -> Any:
        """The oldest staged batch, ordered after its copy on the current stream."""
        st = self._ready.popleft()
        self.backend.hand_over(st.batch, st.end)
        batch = st.batch
        st.batch = None
        self.reap()
        return batch

    def reap(self, block: bool = False) -> None:
        """Release host memory of finished copies (wait for the oldest when ``block``)."""
        while self._copying:
            st = self._copying[0]
            if not self.backend.done(st.end):
                if not block:
                    return
                self.backend.wait(st.end)
                block = False
            self._copying.popleft()
            self.last_h2d_s = self.backend.elapsed_s(st.start, st.end)
            self.total_h2d_s += self.last_h2d_s
            if events.active():
                # The copy ran on the side stream, overlapped with compute; its span is
                # for the timeline (the loop only waited if data_wait says so).
                events.emit("h2d_copy", st.issued_at, st.issued_at + self.last_h2d_s,
                            overlapped=True)
            st.host = None
            if st.release is not None:
                st.release()

    @property
    def copying(self) -> int:
        return len(self._copying)

    def clear(self) -> None:
        """Drop staged batches (abandoned epoch); waits for their copies first."""
        while self._copying:
            self.reap(block=True)
        self._ready.clear()
