"""Plan model parallelism: per-rank memory and step time of a layout; pick a layout.

Pure functions of published formulas; every term names its source.

Memory per rank (bytes):

- Training state, 16 bytes per parameter: fp32 weights (4) + gradients (4) + Adam's
  two moments (8); mixed precision (2 + 2 + 12 for fp32 master weights and moments)
  is also 16 (Rajbhandari et al. 2020, ZeRO, section 3.1). A rank holds its stage's
  share (``1/p``) of its tensor share (``1/t``) of the split layers, plus the layers
  tensor parallelism leaves whole (embeddings, head); sharding divides all of it by
  ``d`` (ZeRO-3).
- FSDP's working set: one unit (a layer) gathered whole, fp32, twice (this one and
  the next, prefetched).
- Activations of one micro-batch per layer, ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes
  at 16 bits (Korthikanti et al. 2022, eq. 2 with tensor parallelism, no
  recomputation), doubled for fp32; GPipe keeps ``m`` micro-batches alive, 1F1B at
  most ``p`` (Narayanan et al. 2021, section 2.2). Only when width and sequence
  length are given.

Step time (seconds):

- Compute: the single-device step of the global batch, split evenly over ``p*t*d``
  ranks (an upper bound on efficiency), stretched by the pipeline to ``(m+p-1)/m``
  of itself: the bubble is ``(p-1)/(m+p-1)`` of the schedule (Huang et al. 2019).
- Tensor parallelism: 4 all-reduces of a micro-batch's activations per layer and
  micro-batch, 2 forward + 2 backward (Shoeybi et al. 2019, Megatron-LM, section 3).
- Sharding: all-gather before forward and again before backward (once in a pipeline,
  which keeps the stage gathered), reduce-scatter after backward, each moving
  ``(d-1)/d`` of the stage's fp32 parameters; replicated data parallelism instead
  all-reduces gradients, ``2(d-1)/d`` (Patarasuk & Yuan 2009).
- Pipeline sends: one activation forward and one gradient backward per micro-batch
  and stage boundary; only the fill and drain, ``2(p-1)`` sends, are on the
  critical path (the rest overlap compute).

Communication is counted as exposed (not overlapped): on Gloo / CPU nothing overlaps,
and on GPUs this makes the prediction an upper bound. Which link a group uses follows
the rank order of :mod:`ringtrain.parallel.layout` (tensor innermost): a group whose
span of ranks fits in one host uses the intra-host link, else the network.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ringtrain.errors import ConfigError
from ringtrain.pipeline_bubble import bubble_fraction
from ringtrain.plan.cost import ring_allreduce
from ringtrain.plan.network import Link, Topology

__all__ = [
    "STATE_BYTES_PER_PARAM",
    "LayoutChoice",
    "LayoutPrediction",
    "ModelSpec",
    "bubble_fraction",
    "format_predictions",
    "layouts",
    "predict",
    "recommend",
]

#: fp32 weights + gradients + Adam moments (ZeRO, Rajbhandari et al. 2020).
STATE_BYTES_PER_PARAM = 16
_FP32 = 4
# Keep this much of device memory free for the allocator's fragmentation, the CUDA
# context and temporary buffers.
MEMORY_HEADROOM = 0.9


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a (transformer-like) model."""

    params: int
    layers: int
    hidden: int | None = None
    heads: int | None = None
    seq: int | None = None
    #: Vocabulary: embedding and output layer (``2 * vocab * hidden``) stay whole
    #: under tensor parallelism (they can be split too, but ringtrain does not).
    vocab: int | None = None

    def __post_init__(self) -> None:
        if self.params < 1 or self.layers < 1:
            raise ConfigError(f"a model needs params >= 1 and layers >= 1, got "
                              f"{self.params} and {self.layers}")
        for name in ("hidden", "heads", "seq", "vocab"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} must be >= 1, got {value}")

    @property
    def whole_params(self) -> int:
        """Parameters tensor parallelism does not split."""
        if self.vocab and self.hidden:
            return min(self.params, 2 * self.vocab * self.hidden)
        return 0


@dataclass(frozen=True)
class LayoutChoice:
    pipeline: int
    tensor: int
    data: int
    shard: bool
    microbatches: int
    schedule: str = "1f1b"

    @property
    def gpus(self) -> int:
        return self.pipeline * self.tensor * self.data

    def describe(self) -> str:
        shard = ("shard" if self.shard else "replicate") if self.data > 1 else "-"
        return f"{self.pipeline}x{self.tensor}x{self.data} {shard}"


@dataclass(frozen=True)
class LayoutPrediction:
    """Per-rank memory (bytes) and step time (seconds) of one layout."""

    layout: LayoutChoice
    state_bytes: float
    working_bytes: float
    activation_bytes: float | None
    compute_s: float
    bubble_s: float
    tensor_s: float
    shard_s: float
    data_s: float
    p2p_s: float
    fits: bool | None = None

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.working_bytes + (self.activation_bytes or 0.0)

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.bubble_s + self.tensor_s + self.shard_s + self.data_s
                + self.p2p_s)

    @property
    def bubble_share(self) -> float:
        """The bubble's share of the whole predicted step."""
        return self.bubble_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def schedule_bubble(self) -> float:
        """The bubble's share of the pipelined forward + backward: (p-1)/(m+p-1)."""
        return bubble_fraction(self.layout.pipeline, self.layout.microbatches)

    @property
    def shard_share(self) -> float:
        """FSDP's gathers and scatters as a share of the step."""
        return self.shard_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def data_share(self) -> float:
        """All data-parallel traffic (sharded or replicated) as a share of the step."""
        return (self.shard_s + self.data_s) / self.step_s if self.step_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "pipeline": lay.pipeline, "tensor": lay.tensor, "data": lay.data,
            "shard": lay.shard, "microbatches": lay.microbatches, "schedule": lay.schedule,
            "state_bytes": self.state_bytes, "working_bytes": self.working_bytes,
            "activation_bytes": self.activation_bytes, "memory_bytes": self.memory_bytes,
            "step_s": self.step_s, "compute_s": self.compute_s, "bubble_s": self.bubble_s,
            "tensor_s": self.tensor_s, "shard_s": self.shard_s, "data_s": self.data_s,
            "p2p_s": self.p2p_s, "bubble_share": self.bubble_share,
            "schedule_bubble": self.schedule_bubble, "fits": self.fits,
        }


def _link_for(span: int, topo: Topology) -> Link:
    """The link of a group whose ranks span ``span`` consecutive ranks."""
    return topo.intra if span <= topo.gpus_per_host else topo.inter


def _activation_bytes(spec: ModelSpec, lay: LayoutChoice, micro: float,
                      act_bytes: int) -> float | None:
    if spec.hidden is None or spec.seq is None:
        return None
    s, h, t = spec.seq, spec.hidden, lay.tensor
    a = spec.heads or max(1, h // 64)
    # Korthikanti et al. 2022, eq. 2 (bytes at 16-bit activations), scaled to act_bytes.
    per_layer = s * micro * h * (10 + 24 / t + 5 * a * s / (h * t)) * act_bytes / 2
    in_flight = lay.microbatches if lay.schedule == "gpipe" else min(lay.pipeline,
                                                                       lay.microbatches)
    return per_layer * (spec.layers / lay.pipeline) * in_flight


def predict(spec: ModelSpec, lay: LayoutChoice, *, compute_s: float, global_batch: int,
            topology: Topology, device_memory: float | None = None,
            act_bytes: int = _FP32) -> LayoutPrediction:
    """Memory per rank and step time of ``lay`` (see the module docstring for the terms)."""
    if compute_s <= 0:
        raise ConfigError(f"the single-device step time must be > 0, got {compute_s}")
    p, t, d, m = lay.pipeline, lay.tensor, lay.data, lay.microbatches
    if global_batch % (d * m):
        raise ConfigError(f"global batch {global_batch} does not split into {d} data ranks x "
                          f"{m} micro-batches; choose a batch that is a multiple of {d * m}")
    micro = global_batch / (d * m)
    whole = spec.whole_params
    # The heaviest stage: its share of the split layers, plus the whole layers (the
    # embedding sits on the first stage and the head on the last).
    stage_params = (spec.params - whole) / (p * t) + whole / min(p, 2)
    state = STATE_BYTES_PER_PARAM * stage_params / (d if lay.shard else 1)
    unit = spec.params / spec.layers
    working = 2 * unit / t * _FP32 if lay.shard and d > 1 else 0.0
    acts = _activation_bytes(spec, lay, micro, act_bytes)

    per_rank = compute_s / (p * t * d)
    bubble_s = per_rank * (p - 1) / m
    tensor_s = 0.0
    boundary = (micro * spec.seq * spec.hidden * act_bytes
                if spec.seq is not None and spec.hidden is not None else 0.0)
    if t > 1 and boundary:
        tl = _link_for(t, topology)
        tensor_s = 4 * (spec.layers / p) * m * ring_allreduce(boundary, t, tl.alpha_s,
                                                              tl.bandwidth)
    grads = stage_params * _FP32  # what one model replica's rank gathers / reduces
    dl = _link_for(t * d, topology)
    shard_s = data_s = 0.0
    if d > 1 and lay.shard:
        one = (d - 1) * dl.alpha_s + (d - 1) / d * grads / dl.bandwidth
        shard_s = (2 if p > 1 else 3) * one
    elif d > 1:
        data_s = ring_allreduce(grads, d, dl.alpha_s, dl.bandwidth)
    p2p_s = 0.0
    if p > 1 and boundary:
        pl = _link_for(p * t * d, topology)
        p2p_s = 2 * (p - 1) * (pl.alpha_s + boundary / pl.bandwidth)
    pred = LayoutPrediction(lay, state, working, acts, per_rank, bubble_s, tensor_s, shard_s,
                            data_s, p2p_s)
    if device_memory is not None:
        pred = replace(pred, fits=pred.memory_bytes <= MEMORY_HEADROOM * device_memory)
    return pred


def layouts(gpus: int, spec: ModelSpec, *, gpus_per_host: int, microbatches: int | None = None,
            schedule: str = "1f1b", global_batch: int | None = None) -> list[LayoutChoice]:
    """Every layout worth considering for ``gpus`` ranks.

    Tensor groups stay inside a host (their traffic is per layer) and split the heads
    evenly; stages are at most the layers; the batch must split into the data ranks
    and micro-batches.
    """
    out: list[LayoutChoice] = []
    for p in (k for k in range(1, gpus + 1) if gpus % k == 0):
        if p > spec.layers:
            continue
        for t in (k for k in range(1, gpus // p + 1) if (gpus // p) % k == 0):
            if t > gpus_per_host or (spec.heads and spec.heads % t):
                continue
            d = gpus // (p * t)
            m = 1 if p == 1 else (microbatches or 4 * p)
            if global_batch is not None and global_batch % (d * m):
                continue
            for shard in ((True, False) if d > 1 else (False,)):
                out.append(LayoutChoice(p, t, d, shard, m, schedule))
    return out


def recommend(spec: ModelSpec, gpus: int, *, device_memory: float, compute_s: float,
              global_batch: int, topology: Topology, microbatches: int | None = None,
              schedule: str = "1f1b") -> list[LayoutPrediction]:
    """Layouts that fit ``device_memory`` bytes per device, fastest first.

    Ties (within 1%) go to the layout with less memory per rank. Empty when nothing fits.
    """
    preds = [predict(spec, lay, compute_s=compute_s, global_batch=global_batch,
                     topology=topology, device_memory=device_memory)
             for lay in layouts(gpus, spec, gpus_per_host=topology.gpus_per_host,
                                microbatches=microbatches, schedule=schedule,
                                global_batch=global_batch)]
    fitting = [p for p in preds if p.fits]
    if not fitting:
        return []
    best = min(p.step_s for p in fitting)
    return sorted(fitting, key=lambda p: (round(p.step_s / best, 2), p.memory_bytes))


def _size(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB"


def format_predictions(preds: list[LayoutPrediction], title: str) -> str:
    """A table of predictions (pure)."""
    lines = [title, "",
             "layout (PxTxD)     m       state        acts       total  step ms  bubble  "
             "data comm  tensor comm  fits"]
    for p in preds:
        lay = p.layout
        fits = "-" if p.fits is None else ("yes" if p.fits else "no")
        lines.append(
            f"{lay.describe():<17} {lay.microbatches:>3}  {_size(p.state_bytes):>10}  "
            f"{_size(p.activation_bytes):>10}  {_size(p.memory_bytes):>10}  "
            f"{p.step_s * 1e3:>7.1f}  {p.bubble_share:>6.1%}  {p.data_share:>9.1%}  "
            f"{(p.tensor_s / p.step_s if p.step_s else 0):>11.1%}  {fits:>4}")
    return "\n".join(lines)
