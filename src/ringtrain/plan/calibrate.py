"""Calibrate the planner on this machine and check it against a real training step.

1. An allreduce sweep (4 KB .. 16 MB) on 2 local processes over Gloo on 127.0.0.1
   gives alpha and B of the loopback "network" by least squares on the ring
   formula ``t = 2(n-1) alpha + 2(n-1)/n * m / B``.
2. One process measures the plain step time (forward, backward, SGD) of a small real
   model, the MNIST CNN of the seed article, batch 64, one thread, and its spread.
3. The planner predicts the 2- and 4-process step (one flat allreduce of all
   gradients after backward), and the same step is measured.

Loopback transfers are CPU copies, so when processes outnumber cores both compute
and the link slow down by ``processes / cores``; the prediction says so explicitly
instead of hiding it in a fit. Every child process is joined, and killed on timeout
or error, before any function here returns.
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import socket
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from ringtrain.errors import ConfigError, LaunchError
from ringtrain.plan.layers import Layer, from_module
from ringtrain.plan.network import Link, Topology
from ringtrain.plan.simulate import FRAMEWORKS, Scenario, simulate

__all__ = [
    "SweepPoint",
    "Fit",
    "StepCheck",
    "Calibration",
    "fit_alpha_beta",
    "predict_step",
    "run_calibration",
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
    """Predicted against measured step time at ``world`` processes."""

    world: int
    compute_s: float
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


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

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for check, raw in zip(self.checks, data["checks"]):
            raw["error"] = check.error
        return data


def fit_alpha_beta(points: list[SweepPoint]) -> Fit:
    """Least-squares alpha and B of the ring formula, errors weighted relative to ``t``.

    ``t = alpha * 2(n-1) + beta * 2(n-1)/n * m`` is linear in (alpha, beta = 1/B);
    dividing each row by its measured ``t`` makes small messages (which fix alpha)
    count as much as large ones (which fix B).
    """
    rows = [(2 * (p.world - 1), 2 * (p.world - 1) / p.world * p.nbytes, p.seconds) for p in points if p.world > 1]
    if len(rows) < 2:
        raise ConfigError("need at least two sweep points with 2 or more processes to fit alpha and B")
    s11 = s12 = s22 = b1 = b2 = 0.0
    for x1, x2, t in rows:
        x1, x2, y = x1 / t, x2 / t, 1.0
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
    layers: list[Layer], fit: Fit, world: int, single_step_s: float, *, cores: int, cv: float = 0.0,
) -> tuple[float, float]:
    """Predicted (compute, step) seconds for ``world`` local processes.

    Processes beyond the core count share cores: compute and the loopback link (CPU
    copies) both slow by ``world / cores``.
    """
    share = max(1.0, world / max(cores, 1))
    loop = Link("loopback", fit.bandwidth / share, 1.0, fit.alpha_s * share, "Gloo on 127.0.0.1, fitted")
    sc = Scenario(
        tuple(layers), single_step_s * share, Topology(world, loop, loop), "ring",
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


# ---------------------------------------------------------------- child processes

def _worker(rank: int, world: int, port: int, job: dict[str, Any], out: Any) -> None:
    """Body of one calibration process; reports ``("ok"|"error", rank, payload)``."""
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # one core per process, like one GPU per process
        torch.manual_seed(0)
        if world > 1:
            if os.name == "posix" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # keep Gloo on loopback
            from datetime import timedelta

            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                timeout=timedelta(seconds=job["op_timeout_s"]),
            )
        result: dict[str, Any] = {"sweep": [], "steps": []}
        if world > 1:
            for nbytes in job["sizes"]:
                buf = torch.ones(nbytes // 4)
                dist.all_reduce(buf)  # warm-up: connections, allocations
                times = []
                for _ in range(job["iters"]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(buf)
                    times.append(time.perf_counter() - t0)
                result["sweep"].append((nbytes, statistics.median(times)))
        model = mnist_cnn()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(job["batch"], 1, 28, 28)
        y = torch.randint(0, 10, (job["batch"],))
        params = [p for p in model.parameters() if p.requires_grad]
        for i in range(job["warmup"] + job["steps"]):
            if world > 1 and i == job["warmup"]:
                dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if world > 1:  # one flat allreduce of every gradient, then average
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                dist.all_reduce(flat)
                flat /= world
                offset = 0
                for p in params:
                    n = p.grad.numel()
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                    offset += n
            opt.step()
            if i >= job["warmup"]:
                result["steps"].append(time.perf_counter() - t0)
        if world > 1:
            dist.destroy_process_group()
        out.put(("ok", rank, result))
    except BaseException:  # report anything, the parent decides
        out.put(("error", rank, traceback.format_exc(limit=6)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(world: int, job: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Run ``world`` workers; return their results by rank. No child outlives this call."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # fork after torch is imported is unsafe
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, job, out), daemon=True) for r in range(world)]
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(results) < world:
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"calibration with {world} processes did not finish within {timeout_s:.0f} s; "
                    "is the machine busy? rerun with fewer processes"
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
                raise LaunchError(f"calibration rank {rank} of {world} failed:\n{payload}")
            results[rank] = payload
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
        out.close()
        out.join_thread()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except AttributeError:
        return os.cpu_count() or 1


def run_calibration(
    worlds: tuple[int, ...] = (2, 4), *, sizes: tuple[int, ...] = DEFAULT_SIZES, iters: int = 5,
    steps: int = 12, warmup: int = 3, batch: int = 64, timeout_s: float = 60.0,
) -> Calibration:
    """Measure, fit and predict (see the module docstring). Takes 15-30 s on 2 cores."""
    if any(w < 2 for w in worlds) or not worlds:
        raise ConfigError(f"calibration needs process counts >= 2, got {worlds}")
    if steps < 3 or iters < 1:
        raise ConfigError("calibration needs >= 3 steps and >= 1 iteration per size")
    job = {"sizes": list(sizes), "iters": iters, "steps": steps, "warmup": warmup, "batch": batch,
           "op_timeout_s": max(10.0, timeout_s)}
    started = time.monotonic()

    def left() -> float:
        return max(5.0, timeout_s * (1 + len(worlds)) - (time.monotonic() - started))

    single = _spawn(1, job, min(timeout_s, left()))[0]["steps"]
    single_s = statistics.median(single)
    cv = statistics.pstdev(single) / statistics.fmean(single)
    measured: dict[int, list[dict[str, Any]]] = {w: _spawn(w, job, min(timeout_s, left())) for w in worlds}
    sweep = [SweepPoint(w, nb, t) for w in worlds for nb, t in measured[w][0]["sweep"]]
    base = min(worlds)
    fit = fit_alpha_beta([p for p in sweep if p.world == base])
    layers = from_module(mnist_cnn())
    cores = _cores()
    checks = []
    for w in worlds:
        # Ranks finish a step together (the allreduce syncs them); rank 0's median is the step.
        compute, predicted = predict_step(layers, fit, w, single_s, cores=cores, cv=cv)
        checks.append(StepCheck(w, compute, predicted, statistics.median(measured[w][0]["steps"])))
    notes = [
        f"alpha and B fitted on the {base}-process sweep only; other sweeps are shown for comparison",
        f"{cores} cores: with more processes than cores, compute and loopback copies share them",
    ]
    grad_bytes = 4 * sum(layer.params for layer in layers)
    return Calibration(fit, sweep, checks, single_s, cv, grad_bytes, cores, notes)


def format_calibration(cal: Calibration) -> str:
    """Human-readable report: the fit, the sweep, prediction vs measurement."""
    f = cal.fit
    lines = [
        f"loopback Gloo fit: alpha = {f.alpha_s * 1e6:.1f} us, B = {f.bandwidth / 1e9:.2f} GB/s "
        f"(rms error {100 * f.rms_rel_error:.0f}%)",
        "",
        "allreduce sweep   procs      bytes   measured ms   ring model ms",
    ]
    for p in cal.sweep:
        model = 2 * (p.world - 1) * f.alpha_s + 2 * (p.world - 1) / p.world * p.nbytes / f.bandwidth
        lines.append(f"                  {p.world:5d} {p.nbytes:10d} {p.seconds * 1e3:13.2f} {model * 1e3:15.2f}")
    lines += [
        "",
        f"MNIST CNN, batch 64, 1 thread per process: 1-process step {cal.single_step_s * 1e3:.1f} ms "
        f"(spread {100 * cal.single_step_cv:.1f}%), gradients {cal.gradient_bytes / 1e6:.1f} MB",
        "procs   compute ms   predicted ms   measured ms   error",
    ]
    for c in cal.checks:
        lines.append(
            f"{c.world:5d} {c.compute_s * 1e3:12.1f} {c.predicted_s * 1e3:14.1f} "
            f"{c.measured_s * 1e3:13.1f} {100 * c.error:+6.0f}%"
        )
    lines += ["", *("note: " + n for n in cal.notes)]
    return "\n".join(lines)
