"""The step meter: split every training step into where its time went.

A step runs from the end of the previous step (the optimizer's ``step_end`` event)
to the end of this one. Inside it, the spans published on :mod:`ringtrain.events`
say when the training loop was *blocked*:

=================  ====================================================================
``h2d_copy``       the loop waited for a host-to-device copy (a copy overlapped on a
                   side stream, ``overlapped=True``, blocks nothing: timeline only)
``data_wait``      the loop waited in ``next()`` for a batch
``exchange_wait``  ``step()``/``synchronize()`` waited for gradient exchanges, i.e. the
                   part of the exchange *not* hidden behind backward
``update``         the wrapped optimizer's update
``compute``        everything else: forward + backward (and any other Python in the loop)
=================  ====================================================================

Model parallelism (:mod:`ringtrain.parallel`) adds two phases of its own
(:data:`PARALLEL_PHASES`), taken out of what would otherwise be compute:

===================  ==================================================================
``shard_comm``       FSDP's parameter all-gathers and gradient reduce-scatters
``pipeline_bubble``  a pipeline stage waiting for its neighbours inside the schedule
===================  ==================================================================

They appear in :func:`split_step`'s totals only when such spans occur, and in the
summary under ``"parallel"``.

Spans may overlap (a loader may report a copy inside its own wait); each instant goes
to the first phase in the order above that covers it, so the five phases are disjoint
and add up to the step time *by construction* (:func:`split_step`).

A step is one optimizer update, as in every framework's logs: with gradient
accumulation (``backward_passes_per_step=k``, or k backward passes per ``step()``) it
holds the k batches of the update. Its end is ringtrain's own ``step_end`` (published
by ``DistributedOptimizer``, ``rt.LocalSGD``, ``rt.parallel``); a loop whose optimizer is
not ringtrain's (torch DDP, FSDP) reports its updates through ``opt_step``, the session's
hook on every torch optimizer's ``step()``: such a step ends at the update and is closed
at the next batch request (or the next update when no batch source reports), so an
``opt_step`` inside ringtrain's own update, followed by its ``step_end``, ends nothing.
Once a ``step_end`` has been seen, ``opt_step`` is ignored.

With neither (a loop over ``rt.data.Loader`` that never steps an optimizer), a step runs
from one ``data_wait`` to the next. Those per-batch steps are provisional until the
first update: when one comes, the batches before it were its accumulation (or set-up
before training) and become part of that first step (:attr:`Meter.retracted` says how
many per-batch steps it absorbed), so a k-pass accumulation never shows k-1 short steps.

Everything here is pure bookkeeping on numbers: no threads, no I/O, no clock of its
own, so it is tested with hand-made spans.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PARALLEL_PHASES", "PHASES", "StepRecord", "Meter", "split_step", "summarize",
           "percentile"]

#: The five disjoint phases of a step, in display order.
PHASES: tuple[str, ...] = ("data_wait", "h2d_copy", "compute", "exchange_wait", "update")
#: Phases of model-parallel steps (sharding traffic, pipeline bubble); zero otherwise.
PARALLEL_PHASES: tuple[str, ...] = ("shard_comm", "pipeline_bubble")
# Which blocking phase owns an instant covered by several spans: a copy reported inside
# the loader's wait is the copy; anything blocked is not compute.
_PRIORITY: tuple[str, ...] = ("h2d_copy", "data_wait", "exchange_wait", "shard_comm",
                              "pipeline_bubble", "update")
_PRIORITY_OF = {kind: i for i, kind in enumerate(_PRIORITY)}
# Spans kept between two step ends; a loop that iterates a loader for a long time
# without stepping (evaluation) must not grow memory without bound.
_MAX_PENDING = 4096

Segment = tuple[str, float, float]


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One measured step; times in seconds (``time.perf_counter`` clock)."""

    index: int  #: 0 for the first step this process measured
    start: float
    end: float
    data_wait: float
    h2d_copy: float
    compute: float
    exchange_wait: float
    update: float
    #: Wall time some gradient exchange was in flight (hidden + exposed part).
    exchange: float = 0.0
    exchange_bytes: int = 0
    buckets: int = 0
    #: Tensors exchanged in this step (over all buckets).
    tensors: int = 0
    #: Samples delivered in this step (None when the data source did not say).
    samples: int | None = None
    #: Duration of copies overlapped on a side stream (not part of the split).
    h2d_overlapped: float = 0.0
    #: FSDP all-gathers and reduce-scatters the step waited for (see PARALLEL_PHASES).
    shard_comm: float = 0.0
    #: Time a pipeline stage waited for its neighbours.
    pipeline_bubble: float = 0.0
    #: Bytes FSDP gathered and scattered in this step.
    shard_bytes: int = 0
    #: Batches the data source delivered in this step (k with k-pass accumulation).
    batches: int = 0

    @property
    def step(self) -> float:
        return self.end - self.start

    @property
    def busy(self) -> float:
        """Share of the step the device had work: not waiting for data or exchange.

        The host-side estimate used when no NVML reading exists (a device step leaves
        the CPU free, so waiting is the only thing the host sees as idle device time).
        """
        if self.step <= 0:
            return 0.0
        idle = (self.data_wait + self.h2d_copy + self.exchange_wait + self.shard_comm
                + self.pipeline_bubble)
        return max(0.0, min(1.0, 1.0 - idle / self.step))

    def phase(self, name: str) -> float:
        return float(getattr(self, name))


def _union_length(spans: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``spans`` clipped to ``[lo, hi]``."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(spans):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None and cur_a is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None and cur_a is not None:
        total += cur_b - cur_a
    return total


def split_step(start: float, end: float,
               spans: Sequence[Segment]) -> tuple[dict[str, float], list[Segment]]:
    """Attribute ``[start, end]`` to the five phases.

    ``spans`` are ``(kind, t_start, t_end)`` with kinds from the blocking phases; they
    are clipped to the step and resolved by priority where they overlap; what no span
    covers is ``compute``. Returns the seconds per phase (summing to ``end - start``;
    the :data:`PARALLEL_PHASES` are there only when their spans are) and the disjoint
    segments, in time order, that cover the step.
    """
    clipped = sorted(
        (max(a, start), min(b, end), _PRIORITY_OF[k]) for k, a, b in spans
        if k in _PRIORITY_OF and min(b, end) > max(a, start)
    )
    totals = dict.fromkeys(PHASES, 0.0)
    for _, _, r in clipped:
        if _PRIORITY[r] in PARALLEL_PHASES:
            totals.setdefault(_PRIORITY[r], 0.0)
    segments: list[Segment] = []

    def put(kind: str, a: float, b: float) -> None:
        if b <= a:
            return
        totals[kind] += b - a
        if segments and segments[-1][0] == kind and segments[-1][2] == a:
            segments[-1] = (kind, segments[-1][1], b)
        else:
            segments.append((kind, a, b))

    if all(clipped[i][1] <= clipped[i + 1][0] for i in range(len(clipped) - 1)):
        # The usual case: spans do not overlap, one linear pass.
        cursor = start
        for a, b, r in clipped:
            put("compute", cursor, a)
            put(_PRIORITY[r], a, b)
            cursor = b
        put("compute", cursor, end)
    else:
        # Overlaps: cut the step at every span boundary, give each piece to the
        # highest-priority span covering it. A step has a handful of spans.
        points = sorted({start, end, *(a for a, _, _ in clipped), *(b for _, b, _ in clipped)})
        for a, b in zip(points, points[1:], strict=False):
            owners = [r for sa, sb, r in clipped if sa <= a and sb >= b]
            put(_PRIORITY[min(owners)] if owners else "compute", a, b)
    return totals, segments


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Meter:
    """Assemble step records from timed events and keep rolling statistics.

    Feed it every event (:meth:`feed`); it returns a :class:`StepRecord` when a step
    ends. The first ``warmup`` steps (worker start-up, allocator warm-up, lazy init) are
    recorded in the series but left out of the statistics.

    Args:
        window: steps in the rolling window of :meth:`summary` (``scope="window"``).
        warmup: steps left out of the statistics.
        series_cap: most records kept for the time series; past it every other record
            is dropped (the series keeps its shape at half the resolution).
    """

    def __init__(self, window: int = 100, warmup: int = 1, series_cap: int = 10_000) -> None:
        if window < 1 or warmup < 0 or series_cap < 2:
            raise ValueError(f"bad meter sizes: window={window} warmup={warmup} cap={series_cap}")
        self.window = window
        self.warmup = warmup
        self.series_cap = series_cap
        self.steps_seen = 0  #: all steps, warm-up included
        self.series: list[StepRecord] = []  #: measured steps, warm-up included (capped)
        self.last: StepRecord | None = None
        self.last_segments: list[Segment] = []
        #: What the data source said about the latest batch (epoch, batch, batches, workers).
        self.data_info: dict[str, Any] = {}
        self._recent: deque[StepRecord] = deque()
        self._sums = dict.fromkeys((*PHASES, *PARALLEL_PHASES, "step", "exchange", "bytes",
                                    "samples", "batches"), 0.0)
        self._samples_known = 0
        self._stride = 1  # series keeps one record in every ``_stride`` once capped
        # What ends a step: None until the first update is seen (a batch request ends
        # one meanwhile), then "step_end" (ringtrain's optimizer) or "opt_step" (any
        # torch optimizer's step(), closed at the next batch request).
        self._end_kind: str | None = None
        self._open_end: float | None = None  # an opt_step's time, not yet closed
        self._saw_data = False
        # Per-batch steps finished before any update was seen: the first update absorbs them.
        self._provisional: list[StepRecord] = []
        self._batches = 0
        #: Per-batch steps the latest record absorbed (they were its accumulation).
        self.retracted = 0
        self._last_end: float | None = None
        self._pending: list[Segment] = []
        self._exchanges: list[tuple[float, float]] = []
        self._bytes = 0
        self._buckets = 0
        self._tensors = 0
        self._samples: int | None = None
        self._h2d_overlapped = 0.0
        self._loader_step_open = False
        self._shard_bytes = 0
        #: What the pipeline said about itself (stages, microbatches, stage).
        self.pipeline_info: dict[str, Any] = {}

    # -- feeding ------------------------------------------------------------------------

    def feed(self, kind: str, t_start: float, t_end: float,
             info: Mapping[str, Any]) -> StepRecord | None:
        """Take one event; returns the finished step when ``kind`` ends one."""
        if kind == "step_end":
            self._end_kind, self._open_end = "step_end", None
            return self._finish(t_end)
        if kind == "opt_step":
            if self._end_kind == "step_end":
                return None  # ringtrain's optimizer reports its own step ends
            done = None
            if self._open_end is not None and not self._saw_data:
                # No batch source reports: each update closes the previous one. (With
                # one, the next batch request does, so two optimizers stepping on one
                # batch, a GAN's, make one step.)
                done = self._finish(self._open_end)
            self._end_kind, self._open_end = "opt_step", t_end
            return done
        record = None
        if self._open_end is not None and kind != "update":
            # The loop went on after a torch optimizer's step(): that update ended then.
            # ("update" comes from ringtrain's own optimizer, whose step_end follows.)
            record = self._finish(self._open_end)
            self._open_end = None
        if kind == "data_wait":
            self._saw_data = True
            if self._end_kind is None:
                # No optimizer update seen (yet): a batch request starts the next step.
                if self._loader_step_open:
                    record = self._finish(t_start, provisional=True)
                self._loader_step_open = True
            self._batches += 1
            self._add(kind, t_start, t_end)
            samples = info.get("samples")
            if isinstance(samples, int):
                self._samples = (self._samples or 0) + samples
            if info:
                self.data_info.update(info)
            return record
        if kind == "exchange":
            self._exchanges.append((t_start, t_end))
            self._bytes += int(info.get("bytes", 0))
            self._buckets += 1
            self._tensors += len(info.get("tensors", ()))
        elif kind == "h2d_copy" and info.get("overlapped"):
            self._h2d_overlapped += t_end - t_start
        elif kind in PARALLEL_PHASES:
            self._add(kind, t_start, t_end)
            if kind == "shard_comm":
                self._shard_bytes += int(info.get("bytes", 0))
            elif info:
                self.pipeline_info.update(info)
        elif kind in _PRIORITY_OF:
            self._add(kind, t_start, t_end)
        return record

    def settle(self) -> StepRecord | None:
        """Close an update a torch optimizer made that no later event has closed yet
        (the end of the loop, or a summary read right after ``step()``)."""
        if self._open_end is None:
            return None
        end, self._open_end = self._open_end, None
        return self._finish(end)

    def _add(self, kind: str, t_start: float, t_end: float) -> None:
        if len(self._pending) >= _MAX_PENDING:
            del self._pending[: _MAX_PENDING // 2]
        self._pending.append((kind, t_start, t_end))

    def _finish(self, end: float, provisional: bool = False) -> StepRecord | None:
        absorbed: list[StepRecord] = []
        if not provisional and self._provisional:
            # The first update: the per-batch steps before it were its accumulation.
            absorbed, self._provisional = self._provisional, []
            self._retract(absorbed[0].index)
        start = self._last_end
        if start is None:
            # The first step has no previous end: it starts at its first event.
            firsts = [a for _, a, _ in self._pending] + [a for a, _ in self._exchanges]
            start = min(firsts, default=end)
        start = min(start, end)
        totals, segments = split_step(start, end, self._pending)
        record = StepRecord(
            index=self.steps_seen, start=start, end=end,
            data_wait=totals["data_wait"], h2d_copy=totals["h2d_copy"],
            compute=totals["compute"], exchange_wait=totals["exchange_wait"],
            update=totals["update"],
            exchange=_union_length(self._exchanges, start, end),
            exchange_bytes=self._bytes, buckets=self._buckets, tensors=self._tensors,
            samples=self._samples,
            h2d_overlapped=self._h2d_overlapped,
            shard_comm=totals.get("shard_comm", 0.0),
            pipeline_bubble=totals.get("pipeline_bubble", 0.0),
            shard_bytes=self._shard_bytes, batches=self._batches,
        )
        if absorbed:
            record = _merge([*absorbed, record])
        self.retracted = len(absorbed)
        self._pending.clear()
        self._exchanges.clear()
        self._bytes = self._buckets = self._tensors = 0
        self._samples = None
        self._h2d_overlapped = 0.0
        self._shard_bytes = 0
        self._batches = 0
        self._last_end = end
        self.steps_seen += 1
        self.last, self.last_segments = record, segments
        self._keep(record)
        if record.index >= self.warmup:
            self._roll(record)
        if provisional:
            self._provisional.append(record)
        return record

    def _retract(self, index: int) -> None:
        """Forget the steps from ``index`` on (the newest ones): the first update absorbs them."""
        while self._recent and self._recent[-1].index >= index:
            self._account(self._recent.pop(), -1)
        while self.series and self.series[-1].index >= index:
            self.series.pop()
        self.steps_seen = index

    def _keep(self, record: StepRecord) -> None:
        if record.index % self._stride:
            return
        self.series.append(record)
        if len(self.series) >= self.series_cap:
            self.series = self.series[::2]
            self._stride *= 2

    def _roll(self, record: StepRecord) -> None:
        self._recent.append(record)
        self._account(record, +1)
        if len(self._recent) > self.window:
            self._account(self._recent.popleft(), -1)

    def _account(self, r: StepRecord, sign: int) -> None:
        # Running sums keep the window's statistics O(1) per step (the progress bar
        # reads them every step).
        s = self._sums
        s["data_wait"] += sign * r.data_wait
        s["h2d_copy"] += sign * r.h2d_copy
        s["compute"] += sign * r.compute
        s["exchange_wait"] += sign * r.exchange_wait
        s["update"] += sign * r.update
        s["shard_comm"] += sign * r.shard_comm
        s["pipeline_bubble"] += sign * r.pipeline_bubble
        s["step"] += sign * (r.end - r.start)
        s["exchange"] += sign * r.exchange
        s["bytes"] += sign * r.exchange_bytes
        s["batches"] += sign * r.batches
        if r.samples is not None:
            s["samples"] += sign * r.samples
            self._samples_known += sign

    # -- reading ------------------------------------------------------------------------

    @property
    def recent(self) -> tuple[StepRecord, ...]:
        """The steps in the rolling window, oldest first."""
        return tuple(self._recent)

    @property
    def measured(self) -> int:
        """Steps past warm-up."""
        return max(0, self.steps_seen - self.warmup)

    def shares(self) -> dict[str, float]:
        """Each phase's share of the step time over the rolling window (sums to 1)."""
        total = self._sums["step"]
        if total <= 0:
            return dict.fromkeys(PHASES, 0.0)
        return {name: self._sums[name] / total for name in PHASES}

    def samples_per_s(self) -> float | None:
        """Samples per second over the window, when every step's sample count is known."""
        n = len(self._recent)
        if n == 0 or self._samples_known < n or self._sums["step"] <= 0:
            return None
        return self._sums["samples"] / self._sums["step"]

    def mean_step(self) -> float:
        n = len(self._recent)
        return self._sums["step"] / n if n else 0.0

    @property
    def open_batches(self) -> int:
        """Batches delivered since the last step ended (the step in progress has them)."""
        return self._batches

    def seconds_per_batch(self) -> float:
        """Mean time per batch over the window (a k-pass update takes k batches); the
        mean step when the data source reported no batches."""
        if self._sums["batches"] > 0:
            return self._sums["step"] / self._sums["batches"]
        return self.mean_step()

    def summary(self, scope: str = "window") -> dict[str, Any]:
        """Plain-data statistics over the rolling window or all measured steps (``"all"``)."""
        if scope == "window":
            records: Sequence[StepRecord] = list(self._recent)
        elif scope == "all":
            records = [r for r in self.series if r.index >= self.warmup]
        else:
            raise ValueError(f"scope must be 'window' or 'all', got {scope!r}")
        out = summarize(records, steps_seen=self.steps_seen, warmup=self.warmup)
        if self.pipeline_info:
            out["parallel"]["pipeline"] = dict(self.pipeline_info)
        return out


def _merge(records: Sequence[StepRecord]) -> StepRecord:
    """One step made of consecutive ones (the batches an update accumulated)."""
    first, last = records[0], records[-1]
    known = [r.samples for r in records if r.samples is not None]

    def total(name: str) -> Any:
        return sum(getattr(r, name) for r in records)

    return StepRecord(
        index=first.index, start=first.start, end=last.end,
        data_wait=total("data_wait"), h2d_copy=total("h2d_copy"), compute=total("compute"),
        exchange_wait=total("exchange_wait"), update=total("update"),
        exchange=total("exchange"), exchange_bytes=total("exchange_bytes"),
        buckets=total("buckets"), tensors=total("tensors"),
        samples=sum(known) if known else None, h2d_overlapped=total("h2d_overlapped"),
        shard_comm=total("shard_comm"), pipeline_bubble=total("pipeline_bubble"),
        shard_bytes=total("shard_bytes"), batches=total("batches"),
    )


def summarize(records: Sequence[StepRecord], steps_seen: int = 0, warmup: int = 0) -> dict[str, Any]:
    """Statistics of ``records`` as plain data (JSON-ready); see docs/observe.md."""
    n = len(records)
    steps = [r.step for r in records]
    total = float(sum(steps))
    phase_sums = {name: sum(r.phase(name) for r in records) for name in PHASES}
    busy = [r.busy for r in records]
    samples = [r.samples for r in records]
    exchange = sum(r.exchange for r in records)
    out: dict[str, Any] = {
        "steps": n,
        "steps_seen": steps_seen,
        "warmup": warmup,
        "time_s": total,
        "step_s": {
            "mean": total / n if n else 0.0,
            "p50": percentile(steps, 50),
            "p90": percentile(steps, 90),
            "min": min(steps, default=0.0),
            "max": max(steps, default=0.0),
        },
        "phases_s": {name: (phase_sums[name] / n if n else 0.0) for name in PHASES},
        "shares": {name: (phase_sums[name] / total if total > 0 else 0.0) for name in PHASES},
        "device_busy": {
            "mean": (1.0 - (phase_sums["data_wait"] + phase_sums["h2d_copy"]
                            + phase_sums["exchange_wait"]) / total) if total > 0 else 0.0,
            "p10": percentile(busy, 10),
            "p50": percentile(busy, 50),
            "p90": percentile(busy, 90),
            "source": "host",
        },
        "samples_per_s": (sum(s for s in samples if s is not None) / total
                          if n and total > 0 and all(s is not None for s in samples) else None),
        "steps_per_s": n / total if total > 0 else 0.0,
        # Batches the data source delivered per step (an update of k accumulated batches: k).
        "batches_per_step": (sum(r.batches for r in records) / n) if n else 0.0,
        "exchange": {
            "bytes_per_step": (sum(r.exchange_bytes for r in records) / n) if n else 0.0,
            "buckets_per_step": (sum(r.buckets for r in records) / n) if n else 0.0,
            "tensors_per_step": (sum(r.tensors for r in records) / n) if n else 0.0,
            "in_flight_s": exchange / n if n else 0.0,
            # How much of the exchange backward hid: 1 - exposed / in flight.
            "hidden_share": (max(0.0, 1.0 - phase_sums["exchange_wait"] / exchange)
                             if exchange > 0 else None),
        },
        "h2d_overlapped_s": (sum(r.h2d_overlapped for r in records) / n) if n else 0.0,
    }
    parallel: dict[str, Any] = {}
    for name in PARALLEL_PHASES:
        seconds = sum(r.phase(name) for r in records)
        parallel[name] = {"s": seconds / n if n else 0.0,
                          "share": seconds / total if total > 0 else 0.0}
    parallel["shard_bytes_per_step"] = (sum(r.shard_bytes for r in records) / n) if n else 0.0
    parallel["pipeline"] = None
    out["parallel"] = parallel
    # The device also idles while it waits for shards or for pipeline neighbours.
    idle_parallel = sum(parallel[name]["share"] for name in PARALLEL_PHASES)
    out["device_busy"]["mean"] = max(0.0, out["device_busy"]["mean"] - idle_parallel)
    return out
