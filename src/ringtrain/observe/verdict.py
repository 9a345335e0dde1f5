"""The doctor's diagnosis: input-, exchange- or compute-bound, with numbers and advice.

A pure function of the per-rank reports (:meth:`ringtrain.observe.session.Session.report`),
so every verdict and every piece of advice is unit-tested on hand-made numbers.

How the verdict is reached. In synchronous data parallelism a rank that is late (say,
starved of data) makes every other rank wait at the gradient exchange, so the mean
exchange wait overstates the network. The rank that waits *least* at the exchange is
the last to arrive; its wait is the exchange's own cost. Hence

* data score = the largest data-wait share (wait + blocking copy) of any rank,
* exchange score = the smallest exchange-wait share of any rank,
* whichever is larger and at least :data:`BOUND_SHARE` names the bottleneck;
  below that on both counts the device is busy and the job is compute-bound.

Model-parallel jobs (:mod:`ringtrain.parallel`) bring two more scores, zero for every
other job: the pipeline bubble (the mean share of the step the stages wait for their
neighbours) and the sharding traffic (the smallest share any rank waits for FSDP's
gathers and scatters, by the same last-to-arrive argument as the exchange). They can
name the job "pipeline-bound" or "shard-bound".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ringtrain.pipeline_bubble import bubble_fraction

__all__ = ["BOUND_SHARE", "LOWCOMM_SHARE", "RankView", "Diagnosis", "diagnose", "render", "rank_view"]

#: A blocker that takes this share of the step or more is worth fixing first: the
#: device idles for it on every step (and 10% is about what scaling studies lose to
#: communication at 90% efficiency: the published results ringtrain.plan.validation
#: checks the planner against).
BOUND_SHARE = 0.10
# Share of a step that a blocking host-to-device copy may take before it gets its own advice.
_COPY_SHARE = 0.05
# Headroom over the measured demand when sizing a worker pool, so the queue absorbs
# batches that take longer than average.
_WORKER_HEADROOM = 1.2
#: An exchange above this share of the step is worth exchanging less often: rt.DiLoCo
#: (or rt.LocalSGD) every H steps can then make steps up to 1/(1 - share) faster, more
#: than the convergence it costs (docs/lowcomm.md; `ringtrain plan --lowcomm` says the same).
LOWCOMM_SHARE = 0.5
# The H the advice proposes: the smallest of these whose exchange is at most a tenth of
# the compute (as ringtrain.plan.lowcomm.recommend chooses).
_SYNC_EVERY = (2, 5, 10, 20, 50, 100, 200, 500, 1000)
_MB = 1024 * 1024


@dataclass(frozen=True)
class RankView:
    """The numbers of one rank that the verdict uses."""

    rank: int
    steps: int
    step_s: float
    step_p90_s: float
    shares: dict[str, float]
    busy: float
    busy_p10: float
    busy_p90: float
    busy_source: str
    samples_per_s: float | None
    bytes_per_step: float
    buckets_per_step: float
    tensors_per_step: float
    hidden_share: float | None
    workers: int | None
    source: str | None
    cpus_per_rank: float
    cpus: int
    local_size: int
    fusion_mb: float
    gpu: dict[str, Any] | None
    #: Share of the step waiting for pipeline neighbours / for FSDP gathers + scatters.
    bubble_share: float = 0.0
    shard_share: float = 0.0
    shard_bytes_per_step: float = 0.0
    #: What the pipeline reported: stages, microbatches, stage (None: no pipeline).
    pipeline: dict[str, Any] | None = None
    #: How the loader's dataset decodes images: "whole", "DecodeCrop", "DecodeCrop(cuda)"
    images: str | None = None
    #: Ranks in the job (the report's world size).
    size: int = 1
    #: Batches per step (an optimizer update of k accumulated batches: k; 0: not reported).
    batches_per_step: float = 1.0

    @property
    def data_share(self) -> float:
        return self.shares.get("data_wait", 0.0) + self.shares.get("h2d_copy", 0.0)

    @property
    def exchange_share(self) -> float:
        return self.shares.get("exchange_wait", 0.0)


def rank_view(report: dict[str, Any]) -> RankView:
    s = report["summary"]
    cpu = report.get("cpu") or {}
    loader = report.get("loader") or {}
    busy = s["device_busy"]
    workers = loader.get("workers")
    par = s.get("parallel") or {}
    return RankView(
        rank=int(report["rank"]), steps=int(s["steps"]), step_s=float(s["step_s"]["mean"]),
        step_p90_s=float(s["step_s"]["p90"]), shares=dict(s["shares"]),
        busy=float(busy["mean"]), busy_p10=float(busy.get("p10", 0.0)),
        busy_p90=float(busy.get("p90", 0.0)), busy_source=str(busy.get("source", "host")),
        samples_per_s=s.get("samples_per_s"),
        bytes_per_step=float(s["exchange"]["bytes_per_step"]),
        buckets_per_step=float(s["exchange"]["buckets_per_step"]),
        tensors_per_step=float(s["exchange"].get("tensors_per_step", 0.0)),
        hidden_share=s["exchange"].get("hidden_share"),
        workers=int(workers) if isinstance(workers, int) else None,
        source=loader.get("source"),
        cpus_per_rank=float(cpu.get("per_rank", 1.0)), cpus=int(cpu.get("affinity", 1)),
        local_size=int(report.get("local_size", 1)),
        fusion_mb=float((report.get("settings") or {}).get("fusion_mb", 25.0)),
        gpu=s.get("gpu"),
        bubble_share=float((par.get("pipeline_bubble") or {}).get("share", 0.0)),
        shard_share=float((par.get("shard_comm") or {}).get("share", 0.0)),
        shard_bytes_per_step=float(par.get("shard_bytes_per_step", 0.0)),
        pipeline=par.get("pipeline"),
        images=loader.get("images"),
        size=int(report.get("size", 1)),
        batches_per_step=float(s.get("batches_per_step", 1.0)),
    )


@dataclass(frozen=True)
class Diagnosis:
    #: "input-bound" | "exchange-bound" | "compute-bound" | "pipeline-bound" | "shard-bound"
    verdict: str
    headline: str
    evidence: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    ranks: list[RankView] = field(default_factory=list)


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 or x == 0 else f"{x:.1%}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _input_advice(r: RankView) -> list[str]:
    advice: list[str] = []
    # Per batch: a step that accumulates k batches before its update waits for k.
    per = max(1.0, r.batches_per_step)
    data_s = r.step_s * r.data_share / per
    busy_s = max(r.step_s / per - data_s, 1e-9)  # device work the input must keep up with
    in_process = r.workers in (0, None)
    # In the training process every moment of loading blocks the loop, so the wait *is*
    # the load time. With w workers delivering one batch each in turn, a batch takes
    # about w x (time per batch) to make.
    load_s = data_s if in_process else (r.workers or 0) * r.step_s / per
    needed = max(1, math.ceil(_WORKER_HEADROOM * load_s / busy_s))
    budget = max(1, int(r.cpus_per_rank))
    host = (f"this host's CPU budget is {r.cpus_per_rank:g} CPU(s) per rank "
            f"({r.cpus} CPUs, {r.local_size} rank(s) on the host)")
    measured = (f"preparing a batch takes ~{_ms(load_s)} against ~{_ms(busy_s)} of device "
                f"work per batch, so about {needed} worker(s) keep up")
    if in_process:
        where = ("a plain iterable in the training loop" if r.source == "iterable"
                 else "the training process (num_workers=0)")
        advice.append(
            f"loading runs in {where}: {measured}. Use rt.data.Loader(dataset, "
            f"num_workers={min(needed, budget)}, device=rt.device()) ({host}).")
    elif needed > r.workers:  # type: ignore[operator]
        if min(needed, budget) > r.workers:  # type: ignore[operator]
            advice.append(f"raise num_workers from {r.workers} to {min(needed, budget)}: "
                          f"{measured} ({host}).")
        else:
            advice.append(f"{r.workers} workers already use the CPU budget: {measured} "
                          f"({host}); more workers would only share the same cores.")
    if needed > budget:
        advice.append(
            f"~{needed} workers would be needed but the budget allows {budget}: make each "
            "sample cheaper (decode/resize once and store the result, e.g. with "
            "rt.data.RecordWriter; lighter augmentation), or give each rank more CPUs "
            "(fewer ranks per host).")
    advice += _image_advice(r)
    copy = r.shares.get("h2d_copy", 0.0)
    if copy >= _COPY_SHARE:
        advice.append(
            f"copies to the device block the loop {_pct(copy)} of the step: let "
            "rt.data.Loader(device=rt.device()) copy page-locked batches on a side stream, "
            "ahead of the loop.")
    return advice


def _lowcomm_advice(r: RankView) -> list[str]:
    """Exchanging every H steps (rt.DiLoCo / rt.LocalSGD) when the exchange is most of the step."""
    if r.exchange_share <= LOWCOMM_SHARE:
        return []
    exposed = r.step_s * r.exchange_share
    rest = max(r.step_s - exposed, 1e-9)
    h = next((h for h in _SYNC_EVERY if exposed / h <= 0.1 * rest), _SYNC_EVERY[-1])
    step = rest + exposed / h
    return [
        f"the exchange is {_pct(r.exchange_share)} of the step, more than half: exchange every H "
        f"steps instead of every step with rt.DiLoCo(model, inner_opt, outer_opt, sync_every={h}) "
        f"(or rt.LocalSGD): a step would take ~{_ms(step)} instead of {_ms(r.step_s)} "
        f"({r.step_s / step:.1f}x) with {h}x fewer bytes, at a cost in convergence: compare the "
        "loss after the same samples (docs/lowcomm.md; `ringtrain plan --lowcomm` predicts each H)."]


def _image_advice(r: RankView) -> list[str]:
    """Photos decoded whole and then cropped: decode only the crop (CPU), or on the GPU."""
    gpu_idle = r.gpu is not None and r.busy < 1.0 - BOUND_SHARE
    advice: list[str] = []
    if r.images == "whole":
        advice.append(
            "the dataset decodes every image whole before its crop: rt.data.ImageFolder(root, "
            "decode=False, transform=rt.data.DecodeCrop(224)) draws the RandomResizedCrop box "
            "first and decodes only that region (with libjpeg-turbo 3), then resizes "
            "(docs/data.md, \"DecodeCrop\").")
    if r.images in ("whole", "DecodeCrop") and gpu_idle:
        advice.append(
            f"the GPU is busy only {_pct(r.busy)} of the step: decode on it instead, "
            "crop = rt.data.DecodeCrop(224, device='cuda') as the transform and "
            "rt.data.Loader(..., device='cuda', collate_fn=crop.collate) (nvJPEG, on the "
            "loader's side stream).")
    return advice


def _exchange_advice(r: RankView, worst_wait_rank: RankView) -> list[str]:
    advice: list[str] = _lowcomm_advice(r)
    mb = r.bytes_per_step / _MB
    exposed = r.step_s * r.exchange_share
    advice.append(
        f"compression=rt.Compression.fp16 in DistributedOptimizer halves the {mb:.1f} MB sent "
        f"per step; a bandwidth-bound exchange then waits ~{_ms(exposed / 2)} instead of "
        f"{_ms(exposed)}.")
    buckets = r.buckets_per_step
    if buckets >= 4:
        advice.append(
            f"{buckets:.0f} fusion buckets per step of ~{mb / buckets:.1f} MB each pay a "
            f"fixed latency each: raise fusion_mb from {r.fusion_mb:g} to {2 * r.fusion_mb:g} "
            "(ringrun --fusion-mb / RINGTRAIN_FUSION_MB) for fewer, larger exchanges.")
    elif buckets <= 1 and r.tensors_per_step > 1 and (r.hidden_share or 0.0) < 0.3 and mb > 1:
        advice.append(
            f"all {mb:.1f} MB go in one bucket, which can only start when backward has "
            f"finished ({_pct(r.hidden_share or 0.0)} of the exchange hidden): lower "
            f"fusion_mb to {max(1.0, r.fusion_mb / 4):g} so early buckets overlap backward.")
    rest = r.step_s - exposed
    if rest > 0:
        doubled = exposed / (exposed + 2 * rest)
        advice.append(
            f"the exchange costs ~{_ms(exposed)} per step whatever the batch: doubling the "
            f"per-rank batch (with rt.scale_lr) would cut its share from "
            f"{_pct(r.exchange_share)} to ~{_pct(doubled)}.")
    if worst_wait_rank.rank != r.rank and worst_wait_rank.exchange_share > 2 * r.exchange_share:
        advice.append(
            f"rank {worst_wait_rank.rank} waits {_pct(worst_wait_rank.exchange_share)} at the "
            f"exchange against {_pct(r.exchange_share)} on rank {r.rank}: part of that is "
            f"waiting for rank {r.rank}, the slowest rank.")
    return advice


def _unmetered(ranks: list[RankView]) -> list[str]:
    """What the job spent time on that no publisher reported: ``"data"`` (a data source
    neither rt.data.Loader nor wrapped in rt.observe.instrument: a plain torch DataLoader
    or generator) and ``"exchange"`` (several ranks, but no gradient exchange seen: torch
    DDP or the script's own collectives). The meter counts that time as compute, so a
    compute-bound verdict cannot be told from an input- or exchange-bound one."""
    out = []
    if all(v.source is None and v.data_share == 0 for v in ranks):
        out.append("data")
    if max(max(v.size for v in ranks), len(ranks)) > 1 and all(
            v.bytes_per_step == 0 and v.exchange_share == 0 and v.shard_share == 0
            and v.bubble_share == 0 for v in ranks):
        out.append("exchange")
    return out


_UNMETERED_EVIDENCE = {
    "data": "input: not metered (the loop's data source is neither rt.data.Loader nor wrapped "
            "in rt.observe.instrument): the loop's wait for batches counts as compute and as "
            "device busy here",
    "exchange": "exchange: none metered on {size} ranks: gradients combined by torch DDP or "
                "the script's own collectives count as compute here",
}
_UNMETERED_ADVICE = {
    "data": "meter the data source and run the doctor again: iterate "
            "rt.observe.instrument(loader) (a torch DataLoader, a generator) or use "
            "rt.data.Loader; until then a loop that waits for batches looks like a busy device.",
    "exchange": "meter the gradient exchange and run the doctor again: wrap the optimizer in "
                "rt.DistributedOptimizer(opt, named_parameters=model.named_parameters()) "
                "instead of torch DDP; until then the all-reduce looks like compute.",
}


def _compute_advice(r: RankView, unmetered: list[str],
                    most_waiting: RankView | None = None) -> list[str]:
    """``r``: the last rank to arrive at the exchange (its busy share is the job's);
    ``most_waiting``: the rank that waits longest there, when it waits for ``r``."""
    advice = [_UNMETERED_ADVICE[k] for k in unmetered]
    if most_waiting is not None:
        advice.append(
            f"rank {most_waiting.rank} waits {_pct(most_waiting.exchange_share)} of the step at "
            f"the exchange against {_pct(r.exchange_share)} on rank {r.rank}: it waits for "
            f"rank {r.rank}, the slowest rank (uneven batches, a slower device or a CPU shared "
            "with other work); even out the work and every rank's step gets shorter.")
    if not unmetered:
        advice.append(
            f"the device is busy {_pct(r.busy)} of the step"
            + (f" on rank {r.rank}" if r.size > 1 else "") + ": input and exchange are "
            "hidden. Faster steps now come from less device work per sample: mixed precision "
            "(torch.autocast), a larger per-device batch if memory allows, torch.compile.")
    if "exchange" not in unmetered and most_waiting is None:
        advice.append(
            "adding ranks should scale nearly linearly while the exchange wait stays under "
            f"{_pct(BOUND_SHARE)}; re-run the doctor with -np N to check.")
    gpu = r.gpu
    if gpu and gpu.get("mem_total"):
        used, total = gpu["mem_used_max"], gpu["mem_total"]
        advice.append(f"GPU memory: {used / 2**30:.1f} of {total / 2**30:.1f} GiB used at most"
                      + (": room for a larger batch." if used < 0.7 * total else "."))
    return advice


def _pipeline_advice(ranks: list[RankView], share: float) -> list[str]:
    advice: list[str] = []
    info = next((v.pipeline for v in ranks if v.pipeline), None) or {}
    p, m = info.get("stages"), info.get("microbatches")
    if isinstance(p, int) and isinstance(m, int) and p > 1:
        advice.append(
            f"{p} stages with {m} micro-batches idle (p-1)/(m+p-1) = {_pct(bubble_fraction(p, m))} "
            f"of the step by design (measured {_pct(share)}); microbatches={2 * m} would "
            f"make it {_pct(bubble_fraction(p, 2 * m))}, {4 * m} {_pct(bubble_fraction(p, 4 * m))}, as long as "
            "each micro-batch keeps the device busy; with schedule='1f1b' more "
            "micro-batches cost no activation memory.")
        if share > bubble_fraction(p, m) + 0.05:
            advice.append(
                f"the bubble is {_pct(share - bubble_fraction(p, m))} over the schedule's own: the "
                "stages are unequal or their sends are slow; move the cut (split=[...]) so "
                "each stage has the same work, or use fewer stages.")
    else:
        advice.append("raise microbatches: the bubble is (p-1)/(m+p-1) of the step.")
    spread = sorted(ranks, key=lambda v: v.bubble_share)
    if len(spread) > 1 and spread[-1].bubble_share > 2 * spread[0].bubble_share + 0.05:
        advice.append(
            f"rank {spread[0].rank} waits least ({_pct(spread[0].bubble_share)}) and rank "
            f"{spread[-1].rank} most ({_pct(spread[-1].bubble_share)}): rank "
            f"{spread[0].rank}'s stage is the slowest; give it fewer layers.")
    return advice


def _shard_advice(r: RankView) -> list[str]:
    mb = r.shard_bytes_per_step / _MB
    return [
        f"FSDP gathers parameters and scatters gradients ({mb:.1f} MB per step on rank "
        f"{r.rank}) for {_pct(r.shard_share)} of the step; that traffic is the same "
        "whatever the batch, so a larger per-rank batch (with rt.scale_lr) shrinks its "
        "share.",
        "if the model's state fits one device, shard=False replaces the gathers with one "
        "gradient all-reduce per step; on GPUs FSDP also overlaps gathers with compute, "
        "on CPU (Gloo) nothing overlaps.",
    ]


def diagnose(reports: list[dict[str, Any]]) -> Diagnosis:
    """The verdict for a job from its ranks' reports (each must have measured steps)."""
    ranks = sorted((rank_view(r) for r in reports), key=lambda v: v.rank)
    if not ranks:
        raise ValueError("no reports to diagnose")
    starved = max(ranks, key=lambda v: v.data_share)
    last_to_arrive = min(ranks, key=lambda v: v.exchange_share)
    most_waiting = max(ranks, key=lambda v: v.exchange_share)
    data_score, exchange_score = starved.data_share, last_to_arrive.exchange_share
    n = len(ranks)
    mean = lambda f: sum(f(v) for v in ranks) / n  # noqa: E731
    bubble_score = mean(lambda v: v.bubble_share)
    shard_rank = min(ranks, key=lambda v: v.shard_share)
    shard_score = shard_rank.shard_share

    evidence = [
        f"step time {_ms(mean(lambda v: v.step_s))} (p90 {_ms(mean(lambda v: v.step_p90_s))})"
        + (f", {sum(v.samples_per_s for v in ranks if v.samples_per_s):,.0f} samples/s"
           if all(v.samples_per_s for v in ranks) else ""),
        "where it goes: " + " | ".join(
            f"{name.replace('_', ' ')} {_pct(mean(lambda v, k=name: v.shares.get(k, 0.0)))}"
            for name in ("data_wait", "h2d_copy", "compute", "exchange_wait", "update"))
        + (f" | shard gather/scatter {_pct(mean(lambda v: v.shard_share))}"
           if any(v.shard_share for v in ranks) else "")
        + (f" | pipeline bubble {_pct(bubble_score)}" if any(v.bubble_share for v in ranks)
           else ""),
        f"device busy {_pct(mean(lambda v: v.busy))} (p10 {_pct(mean(lambda v: v.busy_p10))}, "
        f"p90 {_pct(mean(lambda v: v.busy_p90))}; "
        + ("NVML" if ranks[0].busy_source == "nvml" else "host estimate: not waiting for data "
           "or exchange") + ")",
    ]
    first = ranks[0]
    if first.source is not None:
        loads = ("in the training loop (a plain iterable)" if first.source == "iterable"
                 else f"{first.source}, " + ("loading in the training process"
                                             if first.workers == 0 else
                                             f"{first.workers} worker process(es)"
                                             if first.workers else "workers unknown"))
        evidence.append(f"input: {loads}; CPU budget {first.cpus_per_rank:g} per rank")
    unmetered = _unmetered(ranks)
    evidence += [_UNMETERED_EVIDENCE[k].format(size=max(max(v.size for v in ranks), n))
                 for k in unmetered]
    if ranks[0].bytes_per_step:
        hidden = ranks[0].hidden_share
        evidence.append(
            f"exchange: {ranks[0].bytes_per_step / _MB:.2f} MB per step in "
            f"{ranks[0].buckets_per_step:.0f} bucket(s)"
            + (f", {_pct(hidden)} hidden behind backward" if hidden is not None else ""))

    parallel_score = max(bubble_score, shard_score)
    if parallel_score >= BOUND_SHARE and parallel_score > max(data_score, exchange_score):
        if bubble_score >= shard_score:
            return Diagnosis(
                "pipeline-bound",
                f"PIPELINE-BOUND: the stages wait for each other {_pct(bubble_score)} of "
                "each step (the pipeline bubble).",
                evidence, _pipeline_advice(ranks, bubble_score), ranks)
        return Diagnosis(
            "shard-bound",
            f"SHARD-BOUND: {_pct(shard_score)} of each step waits for FSDP's parameter "
            "gathers and gradient scatters"
            + (f", even on rank {shard_rank.rank}, the last to arrive" if n > 1 else "") + ".",
            evidence, _shard_advice(shard_rank), ranks)
    if max(data_score, exchange_score) < BOUND_SHARE:
        # Ranks that wait long at the exchange while the last to arrive does not wait for
        # the slowest rank: name it, rather than calling the waiting time device work.
        straggler = (most_waiting if n > 1 and most_waiting.exchange_share >= BOUND_SHARE
                     and most_waiting.exchange_share > 2 * exchange_score else None)
        caveat = {"data": "the data source", "exchange": "the gradient exchange"}
        return Diagnosis(
            "compute-bound",
            "COMPUTE-BOUND" + (" as far as measured" if unmetered else "")
            + f": data wait ({_pct(data_score)}) and exchange wait "
            f"({_pct(exchange_score)}) are both under {_pct(BOUND_SHARE)} of the step"
            + (f" on rank {last_to_arrive.rank}, the slowest" if straggler else "")
            + (", but " + " and ".join(caveat[k] for k in unmetered)
               + (" were" if len(unmetered) > 1 else " was")
               + " not metered: that time counts as compute" if unmetered else "") + ".",
            evidence, _compute_advice(last_to_arrive, unmetered, straggler), ranks)
    if data_score >= exchange_score:
        who = f" on rank {starved.rank}" if n > 1 else ""
        return Diagnosis(
            "input-bound",
            f"INPUT-BOUND: the training loop waits for data {_pct(data_score)} of each "
            f"step{who}; the device idles meanwhile.",
            evidence, _input_advice(starved), ranks)
    return Diagnosis(
        "exchange-bound",
        f"EXCHANGE-BOUND: {_pct(exchange_score)} of each step waits for the gradient "
        "exchange (the part backward does not hide)"
        + (f", even on rank {last_to_arrive.rank}, the last to arrive" if n > 1 else "") + ".",
        evidence, _exchange_advice(last_to_arrive, most_waiting), ranks)


def render(d: Diagnosis) -> str:
    """The diagnosis as text (the doctor prints it)."""
    lines = [f"verdict: {d.headline}", ""]
    lines += [f"  {e}" for e in d.evidence]
    if len(d.ranks) > 1:
        parallel = any(v.bubble_share or v.shard_share for v in d.ranks)
        lines.append("")
        lines.append("  rank   step      data wait  exchange wait  device busy"
                     + ("  shard comm  bubble" if parallel else ""))
        for v in d.ranks:
            lines.append(f"  {v.rank:<5}  {_ms(v.step_s):<9} {_pct(v.data_share):>9}  "
                         f"{_pct(v.exchange_share):>13}  {_pct(v.busy):>11}"
                         + (f"  {_pct(v.shard_share):>10}  {_pct(v.bubble_share):>6}"
                            if parallel else ""))
    lines.append("")
    lines.append("advice:")
    lines += [f"  - {a}" for a in d.advice]
    return "\n".join(lines)
