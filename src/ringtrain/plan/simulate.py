"""One training step on N GPUs: when gradients are ready, how they are bucketed,
and how much of their exchange hides behind the rest of backward.

The step of one GPU is forward, then backward from the last layer to the first,
then the optimizer update. Backward costs ``backward_fraction`` of the step
(``DEFAULT_BACKWARD_FRACTION``, 2/3: each layer's backward computes two products,
gradient of the input and of the weights, each as costly as its forward one; Kaplan
et al. 2020 count 2 forward and 4 backward FLOPs per parameter and token). Each
layer's share of backward is its share of forward MACs, so a layer's gradients are
ready once every layer after it has run its backward. A fraction of 0 puts every
gradient at the end of the step: the no-overlap case.

Ready gradients go into buckets, and buckets go through one communication channel
in order (one NCCL stream, one Gloo context), each taking the strategy's
alpha-beta time. Two bucketing policies cover the frameworks of the validation:

- static (PyTorch DDP): buckets of ``bucket_bytes`` in ready order, fixed before the
  step; a bucket goes out when its last gradient is ready (Li et al. 2020, VLDB).
- dynamic (Horovod): a background thread runs a cycle every ``cycle_s`` (at once
  when the previous cycle's work took longer); each cycle first negotiates, through
  rank 0, which tensors every rank has ready (a cost that grows with N, see
  :mod:`ringtrain.plan.coordination`), then runs them as fused collectives of up to
  ``bucket_bytes`` (Horovod's tensor fusion, Sergeev & Del Balso 2018).

A parameter server has no single channel: each tensor lives whole on one server,
which takes it from every worker and sends the update back, so servers are
parallel full-duplex channels and the busiest one sets the pace (TensorFlow's
``replica_device_setter`` with greedy placement by size). Workers read a variable
when their next forward reaches it, so pulls overlap the next forward.

The step ends when backward is over and the last bucket is back. Two costs sit on
top of the alpha-beta terms. A fixed CPU cost per gradient tensor (hooks, launches)
on the critical path, a framework fact in :class:`Framework`. And stragglers: a
synchronous step waits for the slowest of N GPUs, whose expected lag behind the
mean grows like ``sigma * sqrt(2 ln N)`` (expected maximum of N normal variables,
Blom's approximation). Its spread, ``DEFAULT_JITTER_CV``, is the planner's one
fitted number (see :mod:`ringtrain.plan.validation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist

from ringtrain.errors import ConfigError
from ringtrain.plan.coordination import negotiation_s
from ringtrain.plan.cost import allreduce_time, check_strategy, ps_one_way
from ringtrain.plan.layers import Layer
from ringtrain.plan.network import Topology

__all__ = [
    "Framework",
    "FRAMEWORKS",
    "Scenario",
    "StepBreakdown",
    "simulate",
    "scaling",
    "straggler_factor",
    "DEFAULT_JITTER_CV",
    "DEFAULT_BACKWARD_FRACTION",
]

#: Relative spread (standard deviation / mean) of one GPU's step time. Not a published
#: measurement: fitted once, on the grid of ``validation.fit_jitter``, so that the
#: Horovod paper's Inception V3 at 128 GPUs (88%) comes out right; it stands for every
#: synchronisation loss the alpha-beta terms leave out (stragglers, OS and network
#: noise; Horovod's negotiation is modelled on its own). Every other validation row is
#: predicted with it.
DEFAULT_JITTER_CV = 0.0425

#: Share of the single-GPU step spent in backward, when gradients become ready: twice
#: the forward (module docstring), the optimizer update neglected.
DEFAULT_BACKWARD_FRACTION = 2 / 3


@dataclass(frozen=True)
class Framework:
    """How a framework turns ready gradients into exchanges."""

    name: str
    #: Bucket cap / fusion threshold in bytes; 0 sends every gradient tensor on its own.
    bucket_bytes: float
    #: Horovod's cycle: 0 means static buckets (DDP), > 0 dynamic fusion every cycle.
    cycle_s: float = 0.0
    #: DDP makes its first bucket small so the exchange starts early.
    first_bucket_bytes: float | None = None
    #: False: one exchange after backward (no overlap at all).
    overlap: bool = True
    #: CPU cost per gradient tensor that delays backward (autograd hooks, copies).
    per_tensor_s: float = 0.0
    #: Dynamic fusion only: latency of one control message of the negotiation that
    #: opens every cycle (see :mod:`ringtrain.plan.coordination`); 0 = no negotiation.
    control_alpha_s: float = 0.0
    #: Dynamic fusion only: the coordinator's cost per other rank in every cycle.
    coordinator_per_rank_s: float = 0.0
    #: Parameter servers only: most bytes/s one process moves through the framework's
    #: transport, whatever the link (None: the link's bandwidth).
    transport_bw: float | None = None
    note: str = ""

    def __post_init__(self) -> None:
        times = (self.cycle_s, self.per_tensor_s, self.control_alpha_s, self.coordinator_per_rank_s)
        if self.bucket_bytes < 0 or min(times) < 0:
            raise ConfigError(f"framework {self.name!r}: sizes and times must be >= 0")
        if self.transport_bw is not None and self.transport_bw <= 0:
            raise ConfigError(f"framework {self.name!r}: transport bandwidth must be > 0, got {self.transport_bw}")


#: Framework presets by the name the CLI takes (``--framework``).
FRAMEWORKS: dict[str, Framework] = {
    # DDP: 25 MB buckets, a 1 MB first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
    # Per-tensor cost: the DDP README's 1-GPU rows, 'no ddp' vs '1M/1G' (DDP with nobody to
    # talk to), are 0.097 -> 0.100 s (ResNet-50, 161 tensors) and 0.162 -> 0.171 s
    # (ResNet-101, 314 tensors): 12 ms over 475 tensors = 25 us per tensor.
    "ddp": Framework("ddp", 25 * 2**20, first_bucket_bytes=2**20, per_tensor_s=25e-6,
                     note="PyTorch DistributedDataParallel"),
    # Horovod 2018 defaults: HOROVOD_FUSION_THRESHOLD 64 MB, HOROVOD_CYCLE_TIME 5 ms, and
    # the coordinator's negotiation every cycle (ringtrain.plan.coordination). Its control
    # messages are MPI over kernel TCP even on RDMA hosts (Horovod's documented mpirun
    # line has '-mca btl ^openib'): 30 us each, the TCP alpha of ringtrain.plan.network.
    # Rank 0's cost per other rank, 2 us, is assumed: the order of the CPU cost of taking
    # one small message off a TCP socket plus parsing a few-entry request list. The
    # validation barely depends on it: 0 to 5 us, refitting the straggler spread each
    # time, moves no row by more than 1.1 points.
    "horovod": Framework("horovod", 64 * 2**20, cycle_s=5e-3, control_alpha_s=30e-6,
                         coordinator_per_rank_s=2e-6, note="Horovod 2018: negotiation, tensor fusion"),
    # TensorFlow (parameter servers) and Caffe2 (Goyal et al.): one exchange per gradient
    # tensor as soon as it is ready, no fusion.
    "per-tensor": Framework("per-tensor", 0.0, note="an exchange per gradient tensor, no fusion"),
    # TensorFlow's parameter servers over gRPC, 2016-17: one server process moved about
    # 0.9 GB/s, far below a 25 Gbit NIC, because gRPC's copies and framing were CPU-bound
    # (tensorflow/tensorflow#6116: 0.9 GB/s for one ps process vs 20 GB/s in-process on a
    # Xeon E5-2630 v3; sharding over 8 ps processes on one host reached 2.6 GB/s).
    "tf-grpc": Framework("tf-grpc", 0.0, transport_bw=0.9e9,
                         note="TensorFlow parameter servers over gRPC (2017)"),
    # A single flat allreduce of every gradient after backward (the simplest loop).
    "flat": Framework("flat", math.inf, overlap=False, note="one allreduce after backward"),
}


@dataclass(frozen=True)
class Scenario:
    """Everything a prediction depends on, except the number of GPUs."""

    layers: tuple[Layer, ...]
    #: Seconds of one step on one GPU without any exchange (forward + backward + update).
    compute_s: float
    topology: Topology
    strategy: str = "ring"
    framework: Framework = field(default_factory=lambda: FRAMEWORKS["horovod"])
    #: Bytes per gradient element on the wire: 4 for fp32, 2 with fp16 compression.
    wire_bytes: int = 4
    #: Parameter servers (shards); None: one per host.
    ps_shards: int | None = None
    #: Servers run on the worker hosts (distributed TensorFlow's usual layout).
    ps_colocated: bool = True
    #: One worker per host sums its GPUs' gradients before pushing (else every GPU pushes).
    ps_per_host: bool = False
    #: Algorithm across hosts for the hierarchical strategy: "ring" or "hd".
    inter: str = "ring"
    #: Share of ``compute_s`` spent in backward; 0 puts every gradient at the end.
    backward_fraction: float = DEFAULT_BACKWARD_FRACTION
    #: Coefficient of variation of one GPU's step time (stragglers); 0 = none.
    jitter_cv: float = DEFAULT_JITTER_CV
    #: Samples per GPU per step, to turn steps into throughput.
    batch: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", check_strategy(self.strategy))
        if not self.layers:
            raise ConfigError("the model has no layers")
        if self.compute_s <= 0:
            raise ConfigError(f"single-GPU step time must be > 0 s, got {self.compute_s}")
        if not 0 <= self.backward_fraction < 1:
            raise ConfigError(
                f"backward fraction must be >= 0 and < 1, got {self.backward_fraction}; it is the share "
                f"of the step spent in backward, e.g. --backward-fraction {DEFAULT_BACKWARD_FRACTION:.2f}"
            )
        if self.wire_bytes not in (2, 4):
            raise ConfigError(f"wire bytes per element must be 4 (fp32) or 2 (fp16), got {self.wire_bytes}")
        if self.inter not in ("ring", "hd"):
            raise ConfigError(f"inter-host algorithm must be 'ring' or 'hd', got {self.inter!r}")
        if self.ps_shards is not None and self.ps_shards < 1:
            raise ConfigError(f"--ps-shards must be >= 1, got {self.ps_shards}")
        if self.jitter_cv < 0 or self.batch < 1:
            raise ConfigError("jitter must be >= 0 and batch >= 1")

    @property
    def gradient_bytes(self) -> float:
        return sum(layer.params for layer in self.layers) * float(self.wire_bytes)


@dataclass(frozen=True)
class StepBreakdown:
    """Where one step's time goes on ``gpus`` GPUs (seconds)."""

    gpus: int
    step_s: float
    #: Forward + backward + update, including stragglers and per-tensor costs.
    compute_s: float
    #: Time the busiest channel was busy exchanging, hidden or not (for parameter
    #: servers: the busiest server link or worker NIC, one direction).
    comm_s: float
    #: Part of the step spent waiting for the exchange after backward ended.
    exposed_s: float
    buckets: int
    throughput: float
    efficiency: float


def straggler_factor(gpus: int, cv: float) -> float:
    """Expected slowest of ``gpus`` step times relative to the mean, for relative spread ``cv``."""
    if gpus <= 1 or cv == 0:
        return 1.0
    # Blom (1958): E[max of n standard normals] ~ inv_cdf((n - 0.375) / (n + 0.25)).
    return 1.0 + cv * NormalDist().inv_cdf((gpus - 0.375) / (gpus + 0.25))


@dataclass(frozen=True)
class _Timeline:
    """Gradient tensors in backward order with their ready times (step starts at 0)."""

    sizes: list[float]
    ready: list[float]
    #: Forward-order index of the layer each tensor belongs to.
    layer: list[int]
    #: When the next step's forward reaches each layer (offset from that step's start).
    use: list[float]
    backward_end: float


def _timeline(sc: Scenario, gpus: int) -> _Timeline:
    stretch = straggler_factor(gpus, sc.jitter_cv)
    fwd = sc.compute_s * (1 - sc.backward_fraction) * stretch
    bwd = sc.compute_s * sc.backward_fraction * stretch
    macs = sum(layer.macs for layer in sc.layers) or 1.0
    before, use = 0.0, []
    for layer in sc.layers:
        use.append(fwd * before / macs)
        before += layer.macs
    per_tensor = sc.framework.per_tensor_s
    t = fwd
    sizes: list[float] = []
    ready: list[float] = []
    owner: list[int] = []
    for idx in reversed(range(len(sc.layers))):
        layer = sc.layers[idx]
        t += bwd * layer.macs / macs
        for size in layer.sizes:
            t += per_tensor
            sizes.append(size * float(sc.wire_bytes))
            ready.append(t)
            owner.append(idx)
    if not sc.framework.overlap:
        ready = [t] * len(ready)
    return _Timeline(sizes, ready, owner, use, t)


def _buckets(sc: Scenario, tl: _Timeline, cost: Callable[[float], float]) -> tuple[float, float, int]:
    """Static buckets through one channel; return (end of last exchange, busy time, count)."""
    fw = sc.framework
    sizes, ready = tl.sizes, tl.ready
    free, busy, count, i, n = 0.0, 0.0, 0, 0, len(sizes)
    while i < n:
        cap = fw.bucket_bytes
        if count == 0 and fw.first_bucket_bytes is not None:
            cap = fw.first_bucket_bytes
        size, j = sizes[i], i + 1
        while j < n and size + sizes[j] <= cap:
            size += sizes[j]
            j += 1
        start = max(free, ready[j - 1])
        took = cost(size)
        free, busy, count, i = start + took, busy + took, count + 1, j
    return free, busy, count


def _cycles(
    sc: Scenario, tl: _Timeline, cost: Callable[[float], float], negotiation: float,
) -> tuple[float, float, int]:
    """Horovod's background loop; return (end of last exchange, busy time, count).

    A cycle starts ``cycle_s`` after the previous one started, or as soon as that
    one's work is over if it took longer. It takes every tensor ready at its start,
    spends ``negotiation`` agreeing on them, then runs them as fused collectives of
    at most ``bucket_bytes`` (a bigger tensor goes alone), one after another.
    """
    fw = sc.framework
    sizes, ready = tl.sizes, tl.ready
    busy, count, i, n = 0.0, 0, 0, len(sizes)
    start, end = 0.0, 0.0
    while i < n:
        if ready[i] > start:
            # Idle cycles (a negotiation with nothing to agree on) until the tensor is
            # ready: cycles keep the cycle_s rhythm while idle, unless the negotiation
            # alone is longer.
            period = max(fw.cycle_s, negotiation)
            start += math.ceil((ready[i] - start) / period - 1e-9) * period
        end = start + negotiation
        last = i
        while last < n and ready[last] <= start + 1e-12:
            last += 1
        while i < last:
            size, j = sizes[i], i + 1
            while j < last and size + sizes[j] <= fw.bucket_bytes:
                size += sizes[j]
                j += 1
            took = cost(size)
            end, busy, count, i = end + took, busy + took, count + 1, j
        start = max(start + fw.cycle_s, end)
    return end, busy, count


def _parameter_servers(sc: Scenario, gpus: int, tl: _Timeline) -> tuple[float, float, int]:
    """Servers as parallel full-duplex channels, pipelined with the next forward.

    Each tensor is pushed by every worker to its server as soon as it is ready
    (server inbound) and pulled back once all pushes are in (server outbound). The
    next step reads a variable only when its forward reaches that layer, so pulls
    overlap the next forward; the step period is the longest of: compute, the
    busiest direction of any server or worker NIC, and, per tensor, the time from
    its gradient being ready to it being back, minus how far into forward it is used.
    Returns (period, busiest link's busy time, tensors).
    """
    topo = sc.topology
    hosts = topo.hosts(gpus)
    shards = sc.ps_shards or hosts
    n = len(tl.sizes)
    # Greedy placement in creation (forward) order, like TensorFlow's
    # GreedyLoadBalancingStrategy: each variable goes to the least-loaded server.
    load = [0.0] * shards
    server = [0] * n
    for i in reversed(range(n)):
        s = min(range(shards), key=load.__getitem__)
        server[i] = s
        load[s] += tl.sizes[i]
    inbound, outbound = [0.0] * shards, [0.0] * shards
    per_server = [0.0] * shards  # one direction; the other runs at the same time
    period = tl.backward_end
    for i in range(n):  # backward order
        took = ps_one_way(
            tl.sizes[i], gpus, topo, colocated=sc.ps_colocated, per_host=sc.ps_per_host,
            transport_bw=sc.framework.transport_bw,
        )
        s = server[i]
        inbound[s] = max(inbound[s], tl.ready[i]) + took
        outbound[s] = max(outbound[s], inbound[s]) + took
        per_server[s] += took
        period = max(period, outbound[s] - tl.use[tl.layer[i]])
    busy = max(per_server)
    period = max(period, busy)
    if hosts > 1:
        # Worker side: each host's GPUs push what its own servers do not hold.
        total = sum(tl.sizes)
        local = min(sum(load[s] for s in range(shards) if s % hosts == h) for h in range(hosts))
        remote = total - local if sc.ps_colocated else total
        senders = 1 if sc.ps_per_host else topo.local(gpus)
        bw = topo.inter.bandwidth
        if sc.framework.transport_bw is not None:
            bw = min(bw, sc.framework.transport_bw)
        nic = topo.inter.alpha_s + senders * remote / bw
        period, busy = max(period, nic), max(busy, nic)
    return period, busy, n


def simulate(sc: Scenario, gpus: int, baseline_gpus: int = 1) -> StepBreakdown:
    """Predict one step on ``gpus`` GPUs; efficiency is relative to ``baseline_gpus``.

    Efficiency is per-GPU throughput at ``gpus`` over per-GPU throughput at the
    baseline (weak scaling: the per-GPU batch stays the same). With the default
    baseline of one GPU, the reference is the plain single-GPU step ``compute_s``.
    """
    if gpus < 1:
        raise ConfigError(f"number of GPUs must be >= 1, got {gpus}")
    tl = _timeline(sc, gpus)
    backward_end = tl.backward_end
    if gpus == 1:
        end, busy, count = backward_end, 0.0, 0
    elif sc.strategy == "ps":
        end, busy, count = _parameter_servers(sc, gpus, tl)
    else:
        def cost(m: float) -> float:
            return allreduce_time(sc.strategy, m, gpus, sc.topology, inter=sc.inter)

        if sc.framework.cycle_s > 0:
            fw = sc.framework
            negotiation = negotiation_s(gpus, fw.control_alpha_s, fw.coordinator_per_rank_s)
            end, busy, count = _cycles(sc, tl, cost, negotiation)
        else:
            end, busy, count = _buckets(sc, tl, cost)
    step = max(backward_end, end)
    if baseline_gpus == 1:
        base = sc.compute_s
    elif baseline_gpus == gpus:
        base = step
    else:
        base = simulate(sc, baseline_gpus).step_s
    return StepBreakdown(
        gpus=gpus,
        step_s=step,
        compute_s=backward_end,
        comm_s=busy,
        exposed_s=step - backward_end,
        buckets=count,
        throughput=gpus * sc.batch / step,
        efficiency=base / step,
    )


def scaling(sc: Scenario, gpu_counts: list[int], baseline_gpus: int = 1) -> list[StepBreakdown]:
    """:func:`simulate` for each count in ``gpu_counts``."""
    return [simulate(sc, n, baseline_gpus) for n in gpu_counts]

