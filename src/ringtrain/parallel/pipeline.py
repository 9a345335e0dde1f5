"""Pipeline parallelism with ``torch.distributed.pipelining`` (GPipe and 1F1B schedules).

Each rank runs one stage. The schedule cuts the batch into ``m`` micro-batches and
streams them through the stages; stage ``s`` can start micro-batch ``i`` only when
stage ``s-1`` has sent it, so at the start and at the end of a step some stages wait:
with equal stages, ``(p-1)/(m+p-1)`` of the step (the bubble, Huang et al. 2019,
GPipe). 1F1B (Narayanan et al. 2019, PipeDream-Flush) has the same bubble but keeps
at most ``p`` micro-batches' activations alive instead of ``m``.

The bubble is *measured* here: the stage times its own work (each micro-batch's
forward, backward, loss and the final gradient reduction); whatever else passes
inside the schedule's step is waiting for a neighbour. Those gaps are published as
``pipeline_bubble`` spans on :mod:`ringtrain.events` and kept in :class:`StageTimes`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ringtrain import events

__all__ = ["BUBBLE_EVENT", "Pipeline", "StageTimes", "build_schedule", "idle_gaps"]

#: Event kind of one idle gap inside a pipelined step.
BUBBLE_EVENT = "pipeline_bubble"

Span = tuple[float, float]


def idle_gaps(start: float, end: float, busy: Sequence[Span]) -> list[Span]:
    """The parts of ``[start, end]`` that no ``busy`` span covers, in time order."""
    gaps: list[Span] = []
    cursor = start
    for a, b in sorted(busy):
        a, b = max(a, start), min(b, end)
        if b <= cursor:
            continue
        if a > cursor:
            gaps.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        gaps.append((cursor, end))
    return gaps


@dataclass
class StageTimes:
    """Per-step timing of this rank's stage: the schedule's wall time and its idle part."""

    steps: list[float] = field(default_factory=list)  #: seconds in the schedule per step
    idle: list[float] = field(default_factory=list)  #: seconds waiting per step
    _busy: list[Span] = field(default_factory=list)

    def bubble_share(self, skip: int = 1) -> float:
        """Idle share of the schedule over the steps after the first ``skip``."""
        steps, idle = self.steps[skip:], self.idle[skip:]
        total = sum(steps)
        return sum(idle) / total if total > 0 else 0.0


def _timed_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):  # type: ignore[misc]
        """A PipelineStage that records when it computes (everything else is waiting)."""

        times: StageTimes
        #: This stage's buffers before torch's metadata inference ran the forward.
        _saved_buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().forward_one_chunk(*args, **kwargs)
            finally:
                self.times._busy.append((t0, time.perf_counter()))

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().backward_one_chunk(*args, **kwargs)
            finally:
                self.times._busy.append((t0, time.perf_counter()))

        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            # torch's schedule finds the activation shapes at the first step by running
            # the stage's forward and backward once more, in training mode, on the first
            # micro-batch (first stage) or on torch.empty() buffers (the others): a
            # BatchNorm there took the uninitialised memory into its running statistics
            # (NaN or 1e34 after one step, so eval() gave NaN) and every buffer counted
            # one batch more than was trained. The schedule forks the RNG around it; the
            # buffers are put back once it is over (the backward still needs them).
            if self._saved_buffers is None:
                self._saved_buffers = [(b, b.detach().clone()) for b in self.submod.buffers()]
            return super()._forward_metadata_inference(*args, **kwargs)

        def _post_metadata_inference_cleanup(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super()._post_metadata_inference_cleanup(*args, **kwargs)
            finally:
                saved, self._saved_buffers = self._saved_buffers, None
                with torch.no_grad():
                    for buffer, value in saved or ():
                        buffer.copy_(value)

        def perform_reduce_grad(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().perform_reduce_grad(*args, **kwargs)
            finally:
                self.times._busy.append((t0, time.perf_counter()))

    return TimedStage


class Pipeline:
    """One rank's stage and its schedule; :meth:`run` is one forward + backward."""

    def __init__(self, stage_module: nn.Module, stage: int, stages: int, microbatches: int,
                 schedule: str, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 device: torch.device, group: Any) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        self.times = StageTimes()
        self.stage_index, self.stages, self.microbatches = stage, stages, microbatches
        timed = _timed_stage_class()
        self.stage = timed(stage_module, stage, stages, device, group=group)
        self.stage.times = self.times
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        timed_loss = self._timed_loss(loss_fn) if loss_fn is not None else None
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        # Each micro-batch's loss (a mean over its samples) is divided by m before its
        # backward, so the summed micro-batch gradients are the batch's mean. Not the
        # schedule's scale_grads=True: that divides every .grad by m after the step,
        # including gradients accumulated by earlier step() calls without an update,
        # which made accumulation over k calls weigh the first ones 1/m^(k-1) too little.
        self.schedule = kind(self.stage, microbatches, loss_fn=timed_loss, scale_grads=False)

    def _timed_loss(self, loss_fn: Callable[[Any, Any], torch.Tensor]
                    ) -> Callable[[Any, Any], torch.Tensor]:
        def loss(output: Any, target: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return loss_fn(output, target) / self.microbatches
            finally:
                self.times._busy.append((t0, time.perf_counter()))
        return loss

    def run(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        """One step's forward and backward; the mean micro-batch loss on the last stage."""
        losses: list[torch.Tensor] = []  # each micro-batch's loss / m
        self.times._busy.clear()
        t0 = time.perf_counter()
        args = (inputs,) if self.is_first else ()
        if self.is_last:
            self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
        else:
            self.schedule.step(*args, return_outputs=False)
        t1 = time.perf_counter()
        gaps = idle_gaps(t0, t1, self.times._busy)
        self.times.steps.append(t1 - t0)
        self.times.idle.append(sum(b - a for a, b in gaps))
        if events.active():
            for a, b in gaps:
                events.emit(BUBBLE_EVENT, a, b, stages=self.stages,
                            microbatches=self.microbatches, stage=self.stage_index)
        if not self.is_last:
            return None
        # The losses were divided by m (above): their sum is the micro-batches' mean.
        return torch.stack([loss.detach() for loss in losses]).sum()


def build_schedule(stage_module: nn.Module, stage: int, stages: int, microbatches: int,
                   schedule: str, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                   device: torch.device, group: Any) -> Pipeline:
    """The :class:`Pipeline` of this rank (``group``: the pipeline process group)."""
    return Pipeline(stage_module, stage, stages, microbatches, schedule, loss_fn, device, group)
