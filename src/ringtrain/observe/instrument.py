"""Report spans from the user's own code: any iterable as a data source, any block as a phase.

``rt.data.Loader`` and ``DistributedOptimizer`` publish their spans themselves. A loop
that feeds batches from something else (a plain generator, a
``torch.utils.data.DataLoader``) wraps it in :func:`instrument` so the meter sees the
time spent waiting in ``next()``; :func:`span` times any block as one of the phases,
e.g. a manual copy to the device::

    for x, y in rt.observe.instrument(my_batches()):
        with rt.observe.span("h2d_copy"):
            x, y = x.to(dev), y.to(dev)

On CUDA a blocking copy (``non_blocking=False``) synchronises its stream: it returns
only once the device has run everything queued before it, the previous step's
backward and update included, since the host runs ahead of the device. Timed as it is,
that wait would be reported as copying; so an ``h2d_copy`` span, while metering is on,
first waits for the current stream (:func:`span`), and the backlog counts as compute.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from ringtrain import events

__all__ = ["instrument", "Instrumented", "span", "batch_size_of"]

T = TypeVar("T")


def batch_size_of(batch: Any) -> int | None:
    """Rows in a batch: the length of its first tensor/array/sequence leaf, if any."""
    for _ in range(4):  # nested tuples/dicts: look a few levels down, no deeper
        shape = getattr(batch, "shape", None)
        if shape is not None:
            return int(shape[0]) if len(shape) else None
        if isinstance(batch, dict):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (tuple, list)) and batch:
            first = batch[0]
            if getattr(first, "shape", None) is None and not isinstance(first, (tuple, list, dict)):
                return len(batch)  # a list of samples
            if len(batch) > 1 and isinstance(first, (tuple, list, dict)) and all(
                    type(b) is type(first) and len(b) == len(first) for b in batch):
                # Samples alike, not collated (collate_fn=lambda b: b, as for detection):
                # [(image, target), ...]. Collated fields differ: (inputs, labels).
                return len(batch)
            batch = first
        else:
            return None
    return None


class Instrumented(Generic[T]):
    """An iterable that emits a ``data_wait`` event for every item it hands out.

    Iterating it iterates ``source`` again (a new epoch); ``len()`` is the source's.
    """

    def __init__(self, source: Iterable[T], epoch: int | None = None) -> None:
        self.source = source
        self.epoch = 0 if epoch is None else epoch
        self._iterations = 0

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        epoch = self.epoch + self._iterations
        self._iterations += 1
        try:
            batches: int | None = len(self.source)  # type: ignore[arg-type]
        except TypeError:
            batches = None
        it = iter(self.source)
        index = 0
        # A loader object (torch's DataLoader, rt.data.Loader) says how many worker
        # processes load for it; the doctor sizes its advice on that. Anything else is a
        # plain iterable: it loads in the training process.
        has_workers = hasattr(self.source, "num_workers")
        kind = type(self.source).__name__ if has_workers else "iterable"
        clock = time.perf_counter
        while True:
            events.check_stop()  # the doctor has its steps: leave before the next batch
            t0 = clock()
            try:
                item = next(it)
            except StopIteration:
                return
            t1 = clock()
            if events.active():
                workers = getattr(self.source, "num_workers", None) if has_workers else 0
                events.emit("data_wait", t0, t1, samples=batch_size_of(item), batch=index,
                            batches=batches, epoch=epoch,
                            workers=workers if isinstance(workers, int) else None, source=kind)
            index += 1
            yield item


def instrument(source: Iterable[T], epoch: int | None = None) -> Iterable[T]:
    """Wrap ``source`` so the step meter sees how long the loop waits for each item.

    A source that publishes its own ``data_wait`` events (it sets the class attribute
    ``publishes_data_wait = True``, as ``rt.data.Loader`` does) is returned as it is, so
    wrapping never counts a wait twice.
    """
    if getattr(source, "publishes_data_wait", False):
        return source
    return Instrumented(source, epoch)


def _drain_current_stream() -> None:
    """Wait for the work queued on the current CUDA stream (nothing when CUDA is unused)."""
    torch = sys.modules.get("torch")  # not imported by anything: no CUDA work to wait for
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


@contextlib.contextmanager
def span(kind: str, **info: Any) -> Iterator[None]:
    """Time the ``with`` block as a ``kind`` event (``"data_wait"``, ``"h2d_copy"``, ...).

    ``"h2d_copy"`` on CUDA, while metering is on: the span starts after the work already
    queued on the current stream is done (a device synchronisation the blocking copy
    inside would make anyway), so the copy is timed and not the compute queued before
    it (see the module doc). A block of ``non_blocking`` copies from pinned memory
    blocks nothing and needs no span: the loader's side-stream copy reports itself.
    """
    if kind == "h2d_copy" and events.active():
        _drain_current_stream()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if events.active():
            events.emit(kind, t0, time.perf_counter(), **info)
