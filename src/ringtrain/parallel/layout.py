"""The layout of a job: how many ranks go to pipeline stages, tensor splits and data.

Pure: no processes, no torch. A :class:`Layout` is checked when it is made and again
against the world size (:meth:`Layout.resolve`); every rank computes the same answer
from the same inputs, so a bad layout is the same one-line :class:`ConfigError` on
every rank before any collective is started (no rank is left waiting for another).

Ranks are laid out as a ``pipeline x data x tensor`` grid, tensor innermost::

    rank = (stage * data + data_rank) * tensor + tensor_rank

so the ranks of one tensor-parallel group are neighbours (the same host, its fastest
links: tensor parallelism exchanges activations in every layer), data-parallel
replicas come next and pipeline stages, which send only one activation per
micro-batch, are furthest apart. This is the order Megatron-LM and torchtitan use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ringtrain.errors import ConfigError
from ringtrain.pipeline_bubble import bubble_fraction

__all__ = ["SCHEDULES", "Coords", "Layout", "divisors"]

#: Pipeline schedules by the name ``Layout.schedule`` takes.
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")

#: Micro-batches per stage when none are given: with m = 4p the bubble
#: (p-1)/(m+p-1) stays under 20% for any p (GPipe, Huang et al. 2019, section 2.2).
MICROBATCHES_PER_STAGE = 4


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order."""
    return [k for k in range(1, n + 1) if n % k == 0]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Coords:
    """Where one rank sits in the layout."""

    stage: int  #: pipeline stage, 0 = the one that reads data
    data: int  #: data-parallel replica (the shard of the global batch it gets)
    tensor: int  #: position in its tensor-parallel group


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism; ``data=None`` means "the rest of the world".

    Args:
        pipeline: pipeline stages (``p``).
        tensor: ranks that split each layer (``t``).
        data: data-parallel replicas (``d``); ``p * t * d`` must be the world size.
        shard: shard parameters, gradients and optimizer state over the ``d``
            replicas (ZeRO-3 / FSDP); ``False`` keeps a full copy on each.
        microbatches: micro-batches per step through the pipeline (``m``); default
            ``4 * p`` with a pipeline, 1 without.
        schedule: ``"1f1b"`` or ``"gpipe"`` (both idle ``(p-1)/(m+p-1)`` of the step;
            1F1B keeps at most ``p`` micro-batches' activations alive instead of ``m``).
    """

    pipeline: int = 1
    tensor: int = 1
    data: int | None = None
    shard: bool = True
    microbatches: int | None = None
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        _positive("pipeline", self.pipeline)
        _positive("tensor", self.tensor)
        if self.data is not None:
            _positive("data", self.data)
        if self.microbatches is not None:
            _positive("microbatches", self.microbatches)
            if self.pipeline == 1 and self.microbatches > 1:
                raise ConfigError(
                    f"microbatches={self.microbatches} needs a pipeline (pipeline > 1); "
                    "without one, drop microbatches or raise pipeline")
        key = self.schedule.strip().lower() if isinstance(self.schedule, str) else self.schedule
        if key not in SCHEDULES:
            raise ConfigError(
                f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}; "
                "pick 1f1b (less activation memory) or gpipe")
        if key != self.schedule:
            object.__setattr__(self, "schedule", key)
        # torch's Schedule1F1B refuses m < p with a bare ValueError, raised only once
        # the mesh is built; checked here it is the same ConfigError on every rank first.
        if key == "1f1b" and self.pipeline > 1 and self.m < self.pipeline:
            raise ConfigError(
                f"schedule 1f1b needs at least as many micro-batches as stages, got "
                f"microbatches={self.m} for pipeline={self.pipeline}; use microbatches >= "
                f"{self.pipeline} (the default is {MICROBATCHES_PER_STAGE} x stages) or "
                "schedule='gpipe'")

    # -- derived ------------------------------------------------------------------------

    @property
    def model_ranks(self) -> int:
        """Ranks that hold one copy of the model: ``pipeline * tensor``."""
        return self.pipeline * self.tensor

    @property
    def m(self) -> int:
        """Micro-batches per step (the default applied)."""
        if self.microbatches is not None:
            return self.microbatches
        return MICROBATCHES_PER_STAGE * self.pipeline if self.pipeline > 1 else 1

    @property
    def bubble(self) -> float:
        """Idle share of a pipelined step: ``(p-1)/(m+p-1)`` (GPipe, Huang et al. 2019)."""
        return bubble_fraction(self.pipeline, self.m)

    @property
    def sharded(self) -> bool:
        """Whether state is actually split (sharding over one replica splits nothing)."""
        return self.shard and (self.data or 1) > 1

    def size(self) -> int:
        if self.data is None:
            raise ConfigError("the layout's data degree is not known yet; call resolve(world_size)")
        return self.pipeline * self.tensor * self.data

    def resolve(self, world_size: int) -> Layout:
        """This layout with ``data`` filled in for ``world_size`` ranks, or a ConfigError."""
        _positive("world size", world_size)
        mr = self.model_ranks
        degrees = f"pipeline {self.pipeline} x tensor {self.tensor}"
        if self.data is None:
            if world_size % mr:
                raise ConfigError(
                    f"layout {degrees} = {mr} ranks per model copy does not divide the "
                    f"world size {world_size}; choose pipeline and tensor degrees whose "
                    f"product divides {world_size} (its divisors: "
                    f"{', '.join(map(str, divisors(world_size)))}), or run a multiple of "
                    f"{mr} ranks")
            return replace(self, data=world_size // mr)
        if mr * self.data != world_size:
            raise ConfigError(
                f"layout {degrees} x data {self.data} = {mr * self.data} ranks, but the "
                f"world has {world_size}; make the product equal the world size (or leave "
                "data out to use the rest)")
        return self

    def coords(self, rank: int) -> Coords:
        """Where ``rank`` sits (see the module docstring for the order)."""
        size = self.size()
        if not 0 <= rank < size:
            raise ConfigError(f"rank {rank} is outside a layout of {size} ranks")
        d = self.data or 1
        return Coords(stage=rank // (d * self.tensor), data=(rank // self.tensor) % d,
                      tensor=rank % self.tensor)

    def rank_of(self, coords: Coords) -> int:
        """The global rank at ``coords`` (inverse of :meth:`coords`)."""
        d = self.data or 1
        return (coords.stage * d + coords.data) * self.tensor + coords.tensor

    def check_batch(self, local_batch: int) -> None:
        """A ConfigError unless ``local_batch`` samples split into the micro-batches."""
        m = self.m
        if self.pipeline > 1 and (local_batch < m or local_batch % m):
            raise ConfigError(
                f"a batch of {local_batch} samples per data rank does not split into "
                f"{m} micro-batches; make the per-rank batch a multiple of {m} (or pass "
                f"microbatches= a divisor of {local_batch})")

    def describe(self) -> str:
        """``"pipeline 2 x tensor 2 x data 2 (sharded), 8 micro-batches, 1f1b"``."""
        d = "?" if self.data is None else str(self.data)
        text = f"pipeline {self.pipeline} x tensor {self.tensor} x data {d}"
        if (self.data or 1) > 1:
            text += " (sharded)" if self.shard else " (replicated)"
        if self.pipeline > 1:
            text += f", {self.m} micro-batches, {self.schedule}"
        return text
