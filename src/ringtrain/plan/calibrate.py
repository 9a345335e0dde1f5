"""Calibrate the planner on this machine and check it against a real training step.

1. An allreduce sweep (4 KB .. 16 MB) on 2 local processes over Gloo on 127.0.0.1
   gives alpha and B of the loopback "network" by least squares on the ring
   formula ``t = 2(n-1) alpha + 2(n-1)/n * m / B``.
2. The calling process measures the plain step time (forward, backward, SGD) of a
   small real model, the MNIST CNN of the seed article, batch 64, one thread (its
   own thread setting and random state are restored), and the spread of that time.
3. The planner predicts the 2- and 4-process step (one flat allreduce of all
   gradients after backward), and the same step is measured. Each run alternates
   steps with and without the exchange; the latter are the compute time "measured
   by the step meter", a second prediction input that sees the same machine load.

Loopback transfers are CPU copies, so when processes outnumber cores both compute
and the link slow down by ``processes / cores``; the prediction says so explicitly
instead of hiding it in a fit. Every child process is joined, and killed on timeout
or error, before any function here returns.

Run as the ranks of a job (``ringrun -np 4 -H a,b,c,d ringtrain plan --calibrate``, or
any launcher ringtrain reads), :func:`run_calibration_in_job` does the same on the job's
own network instead: the sweep over all ranks fits alpha and B of the real links, and the
step of the CNN with one flat allreduce is predicted from the step without it (measured
in the same run) and measured. ``benchmarks/plan_calibrate.py --shaped-hosts`` runs it on
network-namespace hosts with tc-shaped links.
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from ringtrain import sockets
from ringtrain.cpus import cpu_count
from ringtrain.errors import ConfigError, LaunchError
from ringtrain.plan.layers import Layer, from_module
from ringtrain.plan.network import Link, Topology
from ringtrain.plan.simulate import FRAMEWORKS, Scenario, simulate
from ringtrain.processes import SpawnedProcess, stop_sequence

__all__ = [
    "SweepPoint",
    "Fit",
    "StepCheck",
    "Calibration",
    "fit_alpha_beta",
    "predict_step",
    "run_calibration",
    "run_calibration_in_job",
    "format_calibration",
    "mnist_cnn",
]

DEFAULT_SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)


@dataclass(frozen=True)
class SweepPoint:
    """Median seconds of one allreduce of ``nbytes`` over ``world`` processes."""

    world: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Fit:
    """Alpha-beta parameters of a link fitted to a sweep."""

    alpha_s: float
    bandwidth: float
    #: Root-mean-square relative error of the fit over the sweep.
    rms_rel_error: float


@dataclass(frozen=True)
class StepCheck:
    """Predicted against measured step time at ``world`` processes.

    Two predictions, differing only in the compute-time input: ``predicted_s`` starts
    from the 1-process step scaled by core sharing, ``predicted_inworld_s`` from the
    step without exchange measured in the same run (what the step meter would give).
    """

    world: int
    compute_s: float
    predicted_s: float
    inworld_compute_s: float
    predicted_inworld_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured, for the 1-process-based prediction."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def inworld_error(self) -> float:
        """(predicted - measured) / measured, for the in-run compute prediction."""
        return (self.predicted_inworld_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class Calibration:
    """Everything :func:`run_calibration` measured and predicted."""

    fit: Fit
    sweep: list[SweepPoint]
    checks: list[StepCheck]
    single_step_s: float
    single_step_cv: float
    gradient_bytes: int
    cores: int
    notes: list[str] = field(default_factory=list)
    #: What the sweep ran over.
    network: str = "loopback Gloo"
    #: Whether transfers are CPU copies (loopback): then they share cores with compute.
    link_on_cpu: bool = True

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for check, raw in zip(self.checks, data["checks"], strict=True):
            raw["error"] = check.error
            raw["inworld_error"] = check.inworld_error
        return data


def fit_alpha_beta(points: list[SweepPoint]) -> Fit:
    """Least-squares alpha and B of the ring formula, errors weighted relative to ``t``.

    ``t = alpha * 2(n-1) + beta * 2(n-1)/n * m`` is linear in (alpha, beta = 1/B);
    dividing each row by its measured ``t`` makes small messages (which fix alpha)
    count as much as large ones (which fix B).
    """
    rows = [
        (2.0 * (p.world - 1), 2 * (p.world - 1) / p.world * p.nbytes, p.seconds) for p in points if p.world > 1
    ]
    if len(rows) < 2:
        raise ConfigError("need at least two sweep points with 2 or more processes to fit alpha and B")
    s11 = s12 = s22 = b1 = b2 = 0.0
    for u1, u2, t in rows:
        x1, x2, y = u1 / t, u2 / t, 1.0
        s11 += x1 * x1
        s12 += x1 * x2
        s22 += x2 * x2
        b1 += x1 * y
        b2 += x2 * y
    det = s11 * s22 - s12 * s12
    if det <= 0:
        raise ConfigError("sweep sizes must differ to fit alpha and B")
    alpha = (b1 * s22 - b2 * s12) / det
    beta = (s11 * b2 - s12 * b1) / det
    if beta <= 0:
        raise ConfigError("the sweep shows no growth with message size; use larger sizes")
    alpha = max(alpha, 0.0)  # noise can push a tiny alpha below zero
    rel = [((alpha * x1 + beta * x2) - t) / t for x1, x2, t in rows]
    return Fit(alpha, 1.0 / beta, math.sqrt(sum(e * e for e in rel) / len(rel)))


def predict_step(
    layers: list[Layer], fit: Fit, world: int, compute_s: float, *, cores: int, cv: float = 0.0,
    shared: bool = True, link_on_cpu: bool = True,
) -> tuple[float, float]:
    """Predicted (compute, step) seconds for ``world`` local processes.

    With ``shared`` (``compute_s`` is a 1-process time), processes beyond the core
    count share cores: compute and the loopback link (CPU copies) both slow by
    ``world / cores``. Without it ``compute_s`` already is the in-run compute time
    and only the link is slowed; with ``link_on_cpu=False`` (a real network, whose
    time is on the wire) the link is not slowed either.
    """
    share = max(1.0, world / max(cores, 1))
    link_share = share if link_on_cpu else 1.0
    loop = Link("fitted", fit.bandwidth / link_share, 1.0, fit.alpha_s * link_share, "fitted alpha and B")
    sc = Scenario(
        tuple(layers), compute_s * (share if shared else 1.0), Topology(world, loop, loop), "ring",
        FRAMEWORKS["flat"], jitter_cv=cv,
    )
    step = simulate(sc, world)
    return step.compute_s, step.step_s


def mnist_cnn() -> Any:
    """The MNIST CNN of the seed article (Keras example layout), for 28x28 inputs."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.25), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(128, 10),
    )


# ---------------------------------------------------------------- measuring

def _time_steps(job: dict[str, Any], world: int, dist: Any) -> tuple[list[float], list[float]]:
    """Seconds per step of the MNIST CNN without and (for ``world > 1``) with the exchange.

    Steps without and with the exchange alternate, so both see the same load from
    whatever else runs on the machine.
    """
    import torch

    model = mnist_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(job["batch"], 1, 28, 28)
    y = torch.randint(0, 10, (job["batch"],))
    params = [p for p in model.parameters() if p.requires_grad]

    def step(exchange: bool) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if exchange:  # one flat allreduce of every gradient, then average
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        opt.step()
        return time.perf_counter() - t0

    plain: list[float] = []
    full: list[float] = []
    for i in range(job["warmup"] + job["steps"]):
        a = step(False)
        b = step(True) if world > 1 else a
        if i >= job["warmup"]:
            plain.append(a)
            full.append(b)
    return plain, full


def _measure_single(job: dict[str, Any]) -> list[float]:
    """The 1-process step, measured here with one thread; the caller's settings are restored."""
    import torch

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            torch.set_num_threads(1)  # one core per process, like one GPU per process
            torch.manual_seed(0)
            return _time_steps(job, 1, None)[0]
    finally:
        torch.set_num_threads(threads)


def _measure_world(job: dict[str, Any], world: int, dist: Any) -> dict[str, Any]:
    """The allreduce sweep and the timed steps, on every rank of the default group."""
    import torch

    result: dict[str, Any] = {"sweep": []}
    # The first collectives after start-up are slow (lazy connection set-up, ranks
    # still importing); a burst of small ones settles that before timing.
    warm = torch.ones(1024)
    for _ in range(20):
        dist.all_reduce(warm)
    for nbytes in job["sizes"]:
        buf = torch.ones(nbytes // 4)
        for _ in range(2):  # warm-up: allocations for this size
            dist.all_reduce(buf)
        times = []
        for _ in range(job["iters"]):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        result["sweep"].append((nbytes, statistics.median(times)))
    result["plain"], result["steps"] = _time_steps(job, world, dist)
    return result


def _worker(rank: int, world: int, port: int, job: dict[str, Any], out: Any) -> None:
    """Body of one calibration process; reports ``("ok"|"error", rank, payload)``."""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # one core per process, like one GPU per process
        torch.manual_seed(0)
        if os.name == "posix" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep Gloo on loopback
        from datetime import timedelta

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=job["op_timeout_s"]),
        )
        result = _measure_world(job, world, dist)
        dist.destroy_process_group()
        out.put(("ok", rank, result))
    except BaseException:  # report anything, the parent decides
        out.put(("error", rank, traceback.format_exc(limit=6)))


def _spawn(world: int, job: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Run ``world`` workers; return their results by rank. No child outlives this call."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork after torch is imported is unsafe
    out = ctx.Queue()
    # Held, not listening, until the processes are done: rank 0's store binds the port
    # beside it (see ringtrain.sockets), and no other process can take it meanwhile.
    reservation = sockets.reserve("127.0.0.1", 0)
    port = int(reservation.getsockname()[1])
    procs = [ctx.Process(target=_worker, args=(r, world, port, job, out), daemon=True) for r in range(world)]
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        for p in procs:
            p.start()
        while len(results) < world:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"calibration with {world} processes did not finish within {timeout_s:.0f} s; "
                    "is the machine busy? rerun when it is quieter"
                )
            try:
                status, rank, payload = out.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise LaunchError(
                        f"a calibration process exited with code {dead[0].exitcode} before reporting"
                    ) from None
                continue
            if status != "ok":
                last = payload.strip().splitlines()[-1] if payload.strip() else "no details"
                raise LaunchError(f"calibration rank {rank} of {world} failed: {last}")
            results[rank] = payload
        finished = True
        return [results[r] for r in range(world)]
    finally:
        # Reported ranks exit on their own; anything else (an error, a timeout, Ctrl-C)
        # is stopped at once, politely first.
        if finished:
            for p in procs:
                p.join(timeout=10.0)
        stop_sequence([SpawnedProcess(p) for p in procs], grace=2.0)
        reservation.close()
        out.close()
        out.join_thread()


def run_calibration(
    worlds: tuple[int, ...] = (2, 4), *, sizes: tuple[int, ...] = DEFAULT_SIZES, iters: int = 5,
    steps: int = 12, warmup: int = 3, batch: int = 64, timeout_s: float = 60.0,
) -> Calibration:
    """Measure, fit and predict (see the module docstring); about 15-30 s on 2 idle cores.

    ``timeout_s`` bounds each group of processes; past it they are killed and a
    LaunchError says so.
    """
    if any(w < 2 for w in worlds) or not worlds:
        raise ConfigError(f"calibration needs process counts >= 2, got {worlds}")
    if steps < 3 or iters < 1:
        raise ConfigError("calibration needs >= 3 steps and >= 1 iteration per size")
    job = {"sizes": list(sizes), "iters": iters, "steps": steps, "warmup": warmup, "batch": batch,
           "op_timeout_s": max(10.0, timeout_s)}
    single = _measure_single(job)
    single_s = statistics.median(single)
    cv = statistics.pstdev(single) / statistics.fmean(single)
    measured: dict[int, list[dict[str, Any]]] = {w: _spawn(w, job, timeout_s) for w in worlds}
    sweep = [SweepPoint(w, nb, t) for w in worlds for nb, t in measured[w][0]["sweep"]]
    base = min(worlds)
    fit = fit_alpha_beta([p for p in sweep if p.world == base])
    layers = from_module(mnist_cnn())
    cores = cpu_count()
    checks = []
    for w in worlds:
        # Ranks finish a step together (the allreduce syncs them); rank 0's median is the step.
        compute, predicted = predict_step(layers, fit, w, single_s, cores=cores, cv=cv)
        plain = measured[w][0]["plain"]
        spread = statistics.pstdev(plain) / statistics.fmean(plain)
        local, predicted_local = predict_step(
            layers, fit, w, statistics.median(plain), cores=cores, cv=spread, shared=False,
        )
        checks.append(StepCheck(
            w, compute, predicted, local, predicted_local, statistics.median(measured[w][0]["steps"]),
        ))
    notes = [
        f"alpha and B fitted on the {base}-process sweep only; other sweeps are shown for comparison",
        f"{cores} cores: with more processes than cores, compute and loopback copies share them",
    ]
    grad_bytes = 4 * sum(layer.params for layer in layers)
    return Calibration(fit, sweep, checks, single_s, cv, grad_bytes, cores, notes)


def run_calibration_in_job(
    *, sizes: tuple[int, ...] = DEFAULT_SIZES, iters: int = 5, steps: int = 12, warmup: int = 3,
    batch: int = 64,
) -> Calibration | None:
    """Calibrate on the network of the job this process is a rank of; rank 0 gets the
    Calibration, the other ranks None. Every rank must call it.

    Alpha and B are fitted on the sweep over all ranks; the prediction starts from the
    step without exchange measured in the same run (each rank computes on its own host),
    and the link is time on the wire, not shared with compute.
    """
    import torch
    import torch.distributed as dist

    from ringtrain import runtime

    if steps < 3 or iters < 1:
        raise ConfigError("calibration needs >= 3 steps and >= 1 iteration per size")
    owned = not runtime.is_initialized()  # a script's own world stays up for it
    world = runtime.init()
    n = world.env.size
    if n < 2:
        if owned:
            runtime.shutdown()
        raise ConfigError("calibrating in a job needs 2 or more ranks; without a launcher, "
                          "'ringtrain plan --calibrate' measures local processes instead")
    job = {"sizes": list(sizes), "iters": iters, "steps": steps, "warmup": warmup, "batch": batch}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one core per process, like one GPU per process
        torch.manual_seed(0)
        measured = _measure_world(job, n, dist)
    finally:
        torch.set_num_threads(threads)
        if owned:
            runtime.shutdown()
    if world.env.rank != 0:
        return None
    sweep = [SweepPoint(n, nb, t) for nb, t in measured["sweep"]]
    fit = fit_alpha_beta(sweep)
    layers = from_module(mnist_cnn())
    plain = measured["plain"]
    spread = statistics.pstdev(plain) / statistics.fmean(plain)
    compute, predicted = predict_step(layers, fit, n, statistics.median(plain), cores=cpu_count(),
                                      cv=spread, shared=False, link_on_cpu=False)
    check = StepCheck(n, compute, predicted, compute, predicted, statistics.median(measured["steps"]))
    notes = [f"alpha and B fitted on the {n}-rank sweep of this job ({world.env.launcher} launch)",
             "compute is the step without exchange measured in the same run, on every rank's own host"]
    return Calibration(fit, sweep, [check], statistics.median(plain), spread,
                       4 * sum(layer.params for layer in layers), cpu_count(), notes,
                       network=f"Gloo across the job's {n} ranks", link_on_cpu=False)


def format_calibration(cal: Calibration) -> str:
    """Human-readable report: the fit, the sweep, prediction vs measurement."""
    f = cal.fit
    lines = [
        f"{cal.network} fit: alpha = {f.alpha_s * 1e6:.1f} us, B = "
        + (f"{f.bandwidth / 1e9:.2f} GB/s " if f.bandwidth >= 1e9 else f"{f.bandwidth / 1e6:.1f} MB/s ") +
        f"(rms error {100 * f.rms_rel_error:.0f}%)",
        "",
        "allreduce sweep   procs      bytes   measured ms   ring model ms",
    ]
    for p in cal.sweep:
        share = max(1.0, p.world / max(cal.cores, 1)) if cal.link_on_cpu else 1.0  # as in predict_step
        model = 2 * (p.world - 1) * f.alpha_s * share + 2 * (p.world - 1) / p.world * p.nbytes / f.bandwidth * share
        lines.append(f"                  {p.world:5d} {p.nbytes:10d} {p.seconds * 1e3:13.2f} {model * 1e3:15.2f}")
    grads = f"gradients {cal.gradient_bytes / 1e6:.1f} MB"
    if not cal.link_on_cpu:  # in a job: one prediction, from the in-run step
        lines += ["", f"MNIST CNN, batch 64, 1 thread per rank: step without exchange "
                      f"{cal.single_step_s * 1e3:.1f} ms (spread {100 * cal.single_step_cv:.1f}%), {grads}",
                  "ranks   compute ms  predicted ms  measured ms   error"]
        lines += [f"{c.world:5d} {c.inworld_compute_s * 1e3:12.1f} {c.predicted_inworld_s * 1e3:13.1f} "
                  f"{c.measured_s * 1e3:12.1f} {100 * c.inworld_error:+7.1f}%" for c in cal.checks]
        return "\n".join([*lines, "", *("note: " + n for n in cal.notes)])
    lines += [
        "",
        f"MNIST CNN, batch 64, 1 thread per process: 1-process step {cal.single_step_s * 1e3:.1f} ms "
        f"(spread {100 * cal.single_step_cv:.1f}%), {grads}",
        "        from 1-process step x core share     from in-run step without exchange",
        "procs   compute ms  predicted ms  error     compute ms  predicted ms  error     measured ms",
    ]
    for c in cal.checks:
        lines.append(
            f"{c.world:5d} {c.compute_s * 1e3:12.1f} {c.predicted_s * 1e3:13.1f} {100 * c.error:+6.0f}%"
            f" {c.inworld_compute_s * 1e3:14.1f} {c.predicted_inworld_s * 1e3:13.1f} "
            f"{100 * c.inworld_error:+6.0f}% {c.measured_s * 1e3:15.1f}"
        )
    lines += ["", *("note: " + n for n in cal.notes)]
    return "\n".join(lines)
