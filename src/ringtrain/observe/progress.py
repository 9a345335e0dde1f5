"""Rank 0's progress: a tqdm bar on a terminal, a plain line every few seconds elsewhere.

Both show samples/s, the share of the step spent waiting for data and for the gradient
exchange (the two numbers that say the device is starved), and an ETA: to the end of
training when the script said how long it trains (``rt.observe.set_total(epochs=...)``
or ``steps=...``), labelled ``training ETA``; otherwise to the end of the epoch, when
the data source told its length, labelled ``epoch ETA``. A step is an optimizer update
(k batches with k-pass accumulation), so remaining batches are timed per batch. Off with ``RINGTRAIN_PROGRESS=0`` or
``ringrun --no-progress``. Formatting (:func:`format_status`) is pure; only
:class:`Progress` writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from ringtrain.observe.meter import Meter

__all__ = ["Progress", "format_status", "format_duration", "status_of"]

#: Seconds between plain log lines: often enough to follow, rare enough not to flood
#: a log that collects every rank's output.
LINE_INTERVAL_S = 10.0
#: Seconds between refreshes of the bar's text (tqdm throttles its own redraws too).
BAR_INTERVAL_S = 0.5


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_status(stats: dict[str, Any], with_position: bool = True) -> str:
    """One status text from :func:`status_of` data (no step/epoch when ``with_position``
    is false: the bar shows those itself)."""
    parts: list[str] = []
    if with_position:
        parts.append(f"step {stats['step']}")
        if stats.get("batch") is not None:
            total = f"/{stats['batches']}" if stats.get("batches") else ""
            parts.append(f"epoch {stats.get('epoch', 0)} batch {stats['batch'] + 1}{total}")
    rate = stats.get("samples_per_s")
    parts.append(f"{rate:,.0f} samples/s" if rate is not None
                 else f"{stats.get('steps_per_s', 0.0):.2f} steps/s")
    parts.append(f"data wait {stats['data_share']:.0%}")
    parts.append(f"exchange {stats['exchange_share']:.0%}")
    eta = stats.get("eta_s")
    # The bar (no position) shows tqdm's own epoch ETA: only the training's is added.
    if eta is not None and (with_position or stats.get("eta_scope") == "training"):
        parts.append(f"{stats.get('eta_scope', 'epoch')} ETA {format_duration(eta)}")
    return " | ".join(parts)


def _batches_done(meter: Meter) -> int:
    """The epoch's batches inside finished steps."""
    batch = meter.data_info.get("batch")
    return max(0, batch + 1 - meter.open_batches) if isinstance(batch, int) else 0


def status_of(meter: Meter, epochs: int | None = None, steps: int | None = None) -> dict[str, Any]:
    """What the progress display needs, from the meter's rolling window.

    ``epochs`` / ``steps``: how long the script trains (``rt.observe.set_total``); the
    ETA then runs to the end of training, else to the end of the epoch.
    """
    shares = meter.shares()
    mean = meter.mean_step()
    per_batch = meter.seconds_per_batch()
    info = meter.data_info
    batch, batches, epoch = info.get("batch"), info.get("batches"), info.get("epoch", 0)
    eta: float | None = None
    scope = "epoch"
    per_epoch = batches if isinstance(batches, int) and batches > 0 else 0
    in_epoch = isinstance(batch, int) and per_epoch > 0 and per_batch > 0
    # Batches of the epoch not yet in a finished step (a loop without optimizer updates
    # has requested the next one already).
    left = max(0, per_epoch - _batches_done(meter))
    if steps is not None and mean > 0:
        eta, scope = max(0, steps - meter.steps_seen) * mean, "training"
    elif epochs is not None and in_epoch and isinstance(epoch, int):
        eta, scope = (left + max(0, epochs - epoch - 1) * per_epoch) * per_batch, "training"
    elif in_epoch:
        eta = left * per_batch
    return {
        "step": meter.steps_seen,
        "epoch": info.get("epoch", 0),
        "batch": batch if isinstance(batch, int) else None,
        "batches": batches if isinstance(batches, int) else None,
        "samples_per_s": meter.samples_per_s(),
        "steps_per_s": 1.0 / mean if mean > 0 else 0.0,
        "data_share": shares["data_wait"] + shares["h2d_copy"],
        "exchange_share": shares["exchange_wait"],
        "eta_s": eta,
        "eta_scope": scope,
    }


class Progress:
    """Shows the meter's state; call :meth:`update` after every step, :meth:`close` at the end.

    ``tty`` picks the bar (tqdm, when installed) or plain lines written to ``stream``.
    """

    def __init__(self, stream: TextIO, tty: bool, clock: Callable[[], float] = time.monotonic,
                 line_interval_s: float = LINE_INTERVAL_S,
                 bar_factory: Callable[..., Any] | None = None) -> None:
        self._stream = stream
        self._clock = clock
        self._interval = line_interval_s
        self._last = clock()
        self._bar: Any | None = None
        self._bar_epoch: object = None
        self._closed = False
        if tty:
            if bar_factory is None:
                try:
                    from tqdm import tqdm  # optional: pip install 'ringtrain[progress]'
                    bar_factory = tqdm
                except ImportError:
                    bar_factory = None
            self._factory = bar_factory
        else:
            self._factory = None
        self.lines_written = 0

    def update(self, meter: Meter, epochs: int | None = None, steps: int | None = None) -> None:
        """Show the meter's state; ``epochs``/``steps``: the training's length, when known."""
        if self._closed:
            return
        now = self._clock()
        if self._factory is not None:
            self._update_bar(meter, now, epochs, steps)
            return
        if now - self._last >= self._interval and meter.measured > 0:
            self._last = now
            text = format_status(status_of(meter, epochs, steps))
            self._stream.write(f"ringtrain: {text}\n")
            self._stream.flush()
            self.lines_written += 1

    def _update_bar(self, meter: Meter, now: float, epochs: int | None,
                    steps: int | None) -> None:
        info = meter.data_info
        epoch = info.get("epoch")
        if self._bar is None or epoch != self._bar_epoch:
            total = info.get("batches") if isinstance(info.get("batches"), int) else None
            done = _batches_done(meter)
            if self._bar is None:
                assert self._factory is not None
                self._bar = self._factory(total=total, initial=done, unit="batch",
                                          file=self._stream, dynamic_ncols=True,
                                          mininterval=BAR_INTERVAL_S, leave=True)
            else:
                self._bar.reset(total=total)
                self._bar.update(done)
            self._bar_epoch = epoch
            self._bar.set_description(f"epoch {epoch}" if epoch is not None else "train",
                                      refresh=False)
        else:
            # The bar counts the epoch's batches (its total): an update of k accumulated
            # batches moves it k (less the per-batch steps it absorbed, already counted).
            last = meter.last
            batches = last.batches if last is not None and last.batches else 1
            self._bar.update(max(0, batches - meter.retracted))
        if now - self._last >= BAR_INTERVAL_S and meter.measured > 0:
            self._last = now
            self._bar.set_postfix_str(
                format_status(status_of(meter, epochs, steps), with_position=False),
                refresh=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
