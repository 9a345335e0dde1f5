"""The process-wide meter session: one subscriber on :mod:`ringtrain.events` feeding the
step meter, the timeline, the progress display, GPU sampling and the doctor's report.

Importing this module does nothing. ``rt.init()`` calls :func:`arm` when the
``observe`` setting is on (the default) or the doctor asks: that subscribes one
listener, and the first event any publisher emits (the loader's first ``data_wait``,
the optimizer's first exchange) creates the session and hands the event on, so a
process that never trains pays nothing more. It also adds a hook to every torch
optimizer's ``step()`` (``torch.optim.optimizer.register_optimizer_step_post_hook``)
that publishes ``opt_step``: a loop whose optimizer is not ringtrain's (torch DDP with
``no_sync()`` accumulation) is then metered per update, not per batch. :func:`stop` turns it off;
:func:`start` (re)starts it with explicit options.

The doctor (``ringtrain doctor``) talks to the ranks through three environment
variables, read only here:

=========================  ==========================================================
``RINGTRAIN_DOCTOR``       directory where each rank writes ``meter-rank<R>-<pid>.json``
``RINGTRAIN_DOCTOR_STEPS`` measured steps after which the rank writes its report and
                           leaves with ``SystemExit(0)`` at the loop's next check
                           (the end of ``opt.step()`` or the next batch)
                           (0: run the script to its end; reports are written at exit)
``RINGTRAIN_DOCTOR_WARMUP`` steps left out of the statistics (default 5)
=========================  ==========================================================
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ringtrain import events, runtime
from ringtrain.cpus import cpu_budget
from ringtrain.observe.gpu import DeviceStepTimer, NvmlSampler, open_nvml_sampler
from ringtrain.observe.meter import PHASES, Meter, StepRecord, summarize
from ringtrain.observe.progress import Progress
from ringtrain.observe.timeline import TraceRecorder, merge, part_path, wait_and_merge, write_json_atomic

__all__ = [
    "DoctorRequest", "doctor_request", "Session", "start", "stop", "flush", "current",
    "summary", "arm", "disarm", "set_total", "DOCTOR_ENV", "DOCTOR_STEPS_ENV", "DOCTOR_WARMUP_ENV", "REPORT_VERSION",
]

log = logging.getLogger("ringtrain.observe")

DOCTOR_ENV = "RINGTRAIN_DOCTOR"
DOCTOR_STEPS_ENV = "RINGTRAIN_DOCTOR_STEPS"
DOCTOR_WARMUP_ENV = "RINGTRAIN_DOCTOR_WARMUP"
REPORT_VERSION = 1
#: Steps in the rolling window of ``rt.observe.summary()``.
WINDOW = 100
#: Default warm-up steps outside the doctor (the first step includes lazy set-up).
WARMUP = 1
#: The doctor's default warm-up: worker pools, autotuning and allocators settle.
DOCTOR_WARMUP = 5


@dataclass(frozen=True)
class DoctorRequest:
    """What ``ringtrain doctor`` asked of this process."""

    directory: Path
    steps: int = 0
    warmup: int = DOCTOR_WARMUP


def doctor_request(environ: Mapping[str, str] | None = None) -> DoctorRequest | None:
    environ = os.environ if environ is None else environ
    directory = environ.get(DOCTOR_ENV, "")
    if not directory:
        return None

    def number(name: str, default: int) -> int:
        raw = environ.get(name, "")
        try:
            value = int(raw) if raw else default
        except ValueError:
            value = -1
        if value < 0:
            log.warning("%s=%r is not an int >= 0; using %d", name, raw, default)
            return default
        return value

    return DoctorRequest(Path(directory), number(DOCTOR_STEPS_ENV, 0),
                         number(DOCTOR_WARMUP_ENV, DOCTOR_WARMUP))


@dataclass(frozen=True)
class _Facts:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    final: bool = False  # False until rt.init() has run: refresh later


def _facts() -> _Facts:
    if runtime.is_initialized():
        env = runtime.world().env
        return _Facts(env.rank, env.size, env.local_rank, env.local_size, True)
    return _Facts()


def _cuda_index() -> int | None:
    try:
        dev = runtime.device()
    except Exception:
        return None
    if dev.type != "cuda":
        return None
    return dev.index if dev.index is not None else 0


def _cpu_facts(local_size: int) -> dict[str, Any]:
    budget = cpu_budget(share=local_size)
    return {"affinity": budget.affinity, "quota": budget.quota, "per_rank": budget.cpus}


class Session:
    """Everything observe does in one process; see the module docstring."""

    def __init__(self, *, timeline: str = "", progress: bool = True,
                 doctor: DoctorRequest | None = None, window: int = WINDOW,
                 warmup: int | None = None, gpu: bool = True,
                 stream: TextIO | None = None) -> None:
        self.doctor = doctor
        if warmup is None:
            warmup = doctor.warmup if doctor is not None else WARMUP
        self.meter = Meter(window=window, warmup=warmup)
        self.facts = _facts()
        self.timeline_path = timeline
        self.trace = TraceRecorder(self.facts.rank) if timeline else None
        self._want_progress = progress
        self._stream = stream if stream is not None else sys.stderr
        self.progress: Progress | None = None
        self._progress_decided = False
        self.sampler: NvmlSampler | None = None
        self.timer: DeviceStepTimer | None = None
        index = _cuda_index() if gpu else None
        if index is not None:
            self.sampler = open_nvml_sampler(index)
            try:
                import torch

                self.timer = DeviceStepTimer(lambda: torch.cuda.Event(enable_timing=True))
            except Exception:
                self.timer = None
        self.started = time.perf_counter()
        self.reported = False
        self.flushed = False

    # -- the listener -------------------------------------------------------------------

    def on_event(self, kind: str, t_start: float, t_end: float, info: dict[str, Any]) -> None:
        record = self.meter.feed(kind, t_start, t_end, info)
        if self.trace is not None and (kind == "exchange" or (
                kind == "h2d_copy" and info.get("overlapped"))):
            self.trace.span(kind, t_start, t_end, info)
        if record is not None:
            if self.meter.retracted and self.trace is not None:
                # The per-batch steps this first update absorbed leave the timeline.
                self.trace.retract_steps(record.start)
            # Close the finished step before a data wait opens the next one (a loop
            # without optimizer steps ends a step at the next batch request).
            self._on_step(record)
        if kind == "data_wait" and self.timer is not None:
            self.timer.data_ready()

    def _on_step(self, record: StepRecord, closing: bool = False) -> None:
        if not self.facts.final:
            self.facts = _facts()
            if self.trace is not None:
                self.trace.rank = self.facts.rank
        if self.trace is not None:
            self.trace.step(record, self.meter.last_segments)
        if self.timer is not None:
            self.timer.step_end(record.index)
        if not self._progress_decided and not closing:
            self._progress_decided = True
            if self._want_progress and self.facts.rank == 0:
                try:
                    tty = bool(getattr(self._stream, "isatty", lambda: False)())
                except (ValueError, OSError):  # a closed stream (pytest's capture at exit)
                    tty = False
                self.progress = Progress(self._stream, tty)
        if self.progress is not None and not closing:
            self.progress.update(self.meter, _total["epochs"], _total["steps"])
        doctor = self.doctor
        if doctor is not None and doctor.steps and not self.reported \
                and self.meter.measured >= doctor.steps:
            self.write_report(complete=True)
            # The loop leaves at its next check (events.check_stop): a listener never
            # raises into the publisher's code.
            events.request_stop()

    # -- reading ------------------------------------------------------------------------

    def settle(self, closing: bool = False) -> None:
        """Close an update a torch optimizer made that no event has closed yet
        (``closing``: at flush, possibly at exit, when the streams may be closed: no
        progress line for it)."""
        record = self.meter.settle()
        if record is not None:
            self._on_step(record, closing)

    def summary(self, scope: str = "window") -> dict[str, Any]:
        self.settle()
        out = self.meter.summary(scope)
        out["rank"], out["size"] = self.facts.rank, self.facts.size
        records = self.meter.series if scope == "all" else self.meter.recent
        measured = [r for r in records if r.index >= self.meter.warmup]
        self._add_device(out, measured[0].start if measured else None)
        return out

    def _add_device(self, out: dict[str, Any], t_from: float | None) -> None:
        out["gpu"] = None
        if self.sampler is not None:
            gpu = self.sampler.summary(t_from=t_from)
            out["gpu"] = gpu
            if gpu is not None:
                busy = out["device_busy"]
                busy.update(mean=gpu["util_mean"] / 100, p10=gpu["util_p10"] / 100,
                            p90=gpu["util_p90"] / 100, source="nvml")
                busy.pop("p50", None)
        if self.timer is not None and self.timer.times:
            times = [s for _, s in self.timer.times]
            out["device_step_s"] = sum(times) / len(times)

    def report(self, complete: bool) -> dict[str, Any]:
        """The doctor's per-rank document (plain data)."""
        series = self.meter.series
        t0 = series[0].start if series else self.started
        cols: dict[str, list[Any]] = {"index": [], "t": [], "step": [], "busy": [], "samples": []}
        for name in PHASES:
            cols[name] = []
        for r in series:
            cols["index"].append(r.index)
            cols["t"].append(round(r.end - t0, 6))
            cols["step"].append(round(r.step, 6))
            cols["busy"].append(round(r.busy, 4))
            cols["samples"].append(r.samples)
            for name in PHASES:
                cols[name].append(round(r.phase(name), 6))
        gpu_series = None
        if self.sampler is not None:
            got = self.sampler.samples(t_from=t0)
            gpu_series = {"t": [round(s.t - t0, 3) for s in got], "util": [s.util for s in got],
                          "mem_used": [s.mem_used for s in got]}
        settings = runtime.settings()
        info = self.meter.data_info
        f = self.facts
        trace = (str(part_path(self.timeline_path, f.rank, f.size))
                 if self.trace is not None else None)
        return {
            "version": REPORT_VERSION, "rank": f.rank, "size": f.size,
            "local_rank": f.local_rank, "local_size": f.local_size,
            "host": socket.gethostname(), "pid": os.getpid(), "complete": complete,
            "summary": self.summary("all"), "series": cols, "gpu_series": gpu_series,
            "cpu": _cpu_facts(f.local_size),
            "loader": {"workers": info.get("workers"), "source": info.get("source"),
                       # how the dataset decodes images, when the loader knows (doctor advice)
                       **({"images": info["images"]} if info.get("images") else {}),
                       "batches": info.get("batches")},
            "settings": {"fusion_mb": settings.fusion_mb},
            "timeline": trace,
        }

    def write_report(self, complete: bool) -> Path | None:
        if self.doctor is None:
            return None
        f = self.facts
        path = self.doctor.directory / f"meter-rank{f.rank}-{os.getpid()}.json"
        write_json_atomic(path, self.report(complete))
        self.reported = self.reported or complete
        return path

    def flush(self) -> None:
        """Write what is owed (report, timeline) and stop the threads; idempotent."""
        if self.flushed:
            return
        self.flushed = True
        self.settle(closing=True)
        if self.progress is not None:
            self.progress.close()
        if self.sampler is not None:
            self.sampler.stop()
        if self.doctor is not None and not self.reported:
            self.write_report(complete=False)
        if self.trace is not None and self.meter.steps_seen:
            f = self.facts
            self.trace.write(self.timeline_path, f.size)
            if f.size > 1 and f.rank == 0 and self.doctor is None:
                missing = wait_and_merge(self.timeline_path, f.size)
                if missing:
                    log.warning("timeline %s lacks rank(s) %s (their parts did not appear)",
                                self.timeline_path, missing)

    def rewrite_timeline(self) -> None:
        """Write the (flushed) timeline again, so that a Horovod timeline written to the
        same file after the flush (rank 0's, at exit) joins it rather than replacing it
        (see :mod:`ringtrain.observe.timeline`)."""
        if self.trace is None or not self.flushed or not self.meter.steps_seen:
            return
        f = self.facts
        if f.size == 1:
            self.trace.write(self.timeline_path, 1)
        elif f.rank == 0 and self.doctor is None:
            parts = [part_path(self.timeline_path, r, f.size) for r in range(f.size)]
            merge([p for p in parts if p.exists()], self.timeline_path)


# -- process-wide state -------------------------------------------------------------------
# One listener, subscribed once and never swapped while events flow: the bus iterates
# its live list, so a listener that (un)subscribes during an emit would make it skip
# the next one.

_session: Session | None = None
_armed = False  # the listener starts a session by itself at the first event
_atexit_registered = False
_optimizer_hook: Any = None  # the handle of the hook on torch optimizers' step()
#: How long the script trains (set_total): the progress ETA runs to its end.
_total: dict[str, int | None] = {"epochs": None, "steps": None}


def set_total(epochs: int | None = None, steps: int | None = None) -> None:
    """Say how long this run trains, so the progress ETA runs to the end of training.

    ``epochs``: the epochs the loop runs in all, counted as the data source numbers them
    (``loader.set_epoch(epoch)`` for ``epoch in range(epochs)``: a run resumed at epoch
    30 of 90 has 60 to go). ``steps``: the optimizer updates this process makes from its
    start. Without either, the ETA is the epoch's. Call it on any rank, before or
    during training; ``set_total()`` forgets it.
    """
    for name, value in (("epochs", epochs), ("steps", steps)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"set_total({name}={value!r}): give a whole number >= 1, or None")
    if epochs is not None and steps is not None:
        raise ValueError("set_total(): give epochs or steps, not both")
    _total.update(epochs=epochs, steps=steps)


def _optimizer_stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _compiling():
        return  # inside a torch.compile'd step: no Python side effects in the graph
    now = time.perf_counter()
    events.emit("opt_step", now, now)


def _compiling() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.compiler.is_compiling())


def _hook_optimizers(on: bool) -> None:
    global _optimizer_hook
    if on and _optimizer_hook is None:
        # (torch.optim deletes its submodule's name: import the function itself)
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _optimizer_hook = register_optimizer_step_post_hook(_optimizer_stepped)
    elif not on and _optimizer_hook is not None:
        _optimizer_hook.remove()
        _optimizer_hook = None


def current() -> Session | None:
    return _session


def _listen(kind: str, t_start: float, t_end: float, info: dict[str, Any]) -> None:
    session = _session
    if session is None:
        if not _armed:
            return
        session = _create()
    session.on_event(kind, t_start, t_end, info)


def _create(*, timeline: str | None = None, progress: bool | None = None,
            window: int = WINDOW, warmup: int | None = None, gpu: bool = True,
            stream: TextIO | None = None) -> Session:
    global _session, _atexit_registered
    settings = runtime.settings()
    _session = Session(
        timeline=settings.timeline if timeline is None else timeline,
        progress=settings.progress if progress is None else progress,
        doctor=doctor_request(), window=window, warmup=warmup, gpu=gpu, stream=stream,
    )
    if not _atexit_registered:
        atexit.register(flush)
        _atexit_registered = True
    return _session


def start(*, timeline: str | None = None, progress: bool | None = None,
          window: int = WINDOW, warmup: int | None = None, gpu: bool = True,
          stream: TextIO | None = None) -> Session:
    """Start (or restart) metering now; options default to the settings and the doctor's env.

    Call it outside the training step (not from an event listener).
    """
    global _armed
    if _session is not None:
        _session.flush()
    _armed = True
    session = _create(timeline=timeline, progress=progress, window=window, warmup=warmup,
                      gpu=gpu, stream=stream)
    events.subscribe(_listen)
    _hook_optimizers(True)
    return session


def stop() -> dict[str, Any]:
    """Stop metering (it does not restart by itself); returns the final window summary."""
    global _session, _armed
    _armed = False
    events.unsubscribe(_listen)
    _hook_optimizers(False)
    session, _session = _session, None
    if session is None:
        return summary()
    session.flush()
    return session.summary()


def flush() -> None:
    """Write the timeline (and the doctor's report) now; later calls write nothing more."""
    if _session is not None:
        _session.flush()


def summary(scope: str = "window") -> dict[str, Any]:
    """Rolling statistics of this rank's steps as plain data (see docs/observe.md).

    ``scope="window"``: the last :data:`WINDOW` steps; ``"all"``: every measured step.
    """
    if _session is None:
        out = summarize([])
        f = _facts()
        out["rank"], out["size"], out["gpu"] = f.rank, f.size, None
        return out
    return _session.summary(scope)


def arm() -> None:
    """Start a session by itself at the first event (``rt.init()`` does this when the
    ``observe`` setting is on or the doctor asks)."""
    global _armed
    _armed = True
    events.subscribe(_listen)
    _hook_optimizers(True)


def disarm() -> None:
    """No listener on the bus (``RINGTRAIN_OBSERVE=0``); a running session is flushed."""
    stop()
