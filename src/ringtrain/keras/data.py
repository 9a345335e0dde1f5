"""Feed ``rt.data.Loader`` batches to Keras ``fit``/``evaluate``.

Keras 3 accepts a ``keras.utils.PyDataset``; :class:`LoaderDataset` is one whose
batches come, in order, from a ringtrain loader, so each rank trains on its own shard
(the loader's order is a pure function of seed, epoch, rank and world size) and every
rank gets the same number of batches per epoch.

The article's Keras advice maps onto the loader's arguments::

    Keras PyDataset / fit             ringtrain
    workers=8                         Loader(num_workers=8)  ("auto" sizes it from the CPUs)
    use_multiprocessing=True          always: workers are processes, batches travel
                                      through shared memory, not pickles
    max_queue_size=10                 Loader(prefetch=...)   (default 2 per worker)
    (GPU copy)                        Loader(device=rt.device()), page-locked on CUDA

The adapter itself runs with Keras' ``workers=1, use_multiprocessing=False``: the
parallelism lives in the loader, and Keras threads asking for batches out of order
would break the loader's sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ringtrain.errors import ConfigError, DataError
from ringtrain.keras._backend import load_keras

__all__ = ["LoaderDataset"]

keras = load_keras()


class LoaderDataset(keras.utils.PyDataset):  # type: ignore[misc,name-defined]
    """A ``keras.utils.PyDataset`` serving the batches of a ``rt.data.Loader`` in order.

    Args:
        loader: anything with ``__len__`` (batches per epoch), ``__iter__`` and
            ``set_epoch(epoch)``: a ``rt.data.Loader``. Its batches must be what Keras
            expects: ``(x, y)``, ``(x, y, sample_weight)``, ``(x,)`` or a dict.
        initial_epoch: the epoch ``fit`` starts from (pass ``fit``'s
            ``initial_epoch`` when resuming, so the order continues where it was).

    Each Keras epoch calls ``loader.set_epoch(epoch)`` and iterates the loader once.
    The batch index Keras passes to ``__getitem__`` is ignored (``fit(shuffle=True)``
    shuffles indices of a PyDataset): the order is the loader's.
    """

    def __init__(self, loader: Any, initial_epoch: int = 0) -> None:
        super().__init__(workers=1, use_multiprocessing=False)
        for attr in ("__len__", "__iter__", "set_epoch"):
            if not hasattr(loader, attr):
                raise ConfigError(
                    f"LoaderDataset needs a rt.data.Loader (with {attr}), got {type(loader).__name__}"
                )
        if not isinstance(initial_epoch, int) or initial_epoch < 0:
            raise ConfigError(f"initial_epoch must be an int >= 0, got {initial_epoch!r}")
        self.loader = loader
        self.epoch = initial_epoch  # the epoch being served, or the next one
        self._iterator: Iterator[Any] | None = None
        self._served = 0

    def __len__(self) -> int:
        return len(self.loader)

    def on_epoch_begin(self) -> None:
        self._iterator = None  # the first __getitem__ opens self.epoch

    def on_epoch_end(self) -> None:
        # Keras also begins and ends an "epoch" to peek at one batch when it builds the
        # model: only an epoch served in full moves the order on.
        if self._served >= len(self):
            self.epoch += 1
        self._iterator = None
        self._served = 0

    def _restart(self) -> None:
        self.loader.set_epoch(self.epoch)
        self._iterator = iter(self.loader)
        self._served = 0

    def __getitem__(self, index: int) -> Any:
        if self._iterator is None:
            self._restart()
        assert self._iterator is not None
        try:
            batch = next(self._iterator)
        except StopIteration:
            raise DataError(
                f"the loader ended after {self._served} batches of epoch {self.epoch} but "
                f"reported {len(self)}; give Keras the loader's own length (no steps_per_epoch)"
            ) from None
        self._served += 1
        return tuple(batch) if isinstance(batch, list) else batch
