"""The checks that need a GPU, in one short script: run it on a machine with one.

    python benchmarks/gpu_check.py                  # one GPU is enough; prints numbers
    python benchmarks/gpu_check.py --cpu-dry-run    # the same code where it runs without CUDA

1. loader: ``rt.data.Loader(device="cuda")`` page-locks its shared-memory slots
   (``pinned_slots``) and copies batches on a side stream; overlap is the sum of the
   copy-only and compute-only times over the time of both together (> 1: overlapped).
2. a 1-rank NCCL job: every collective on CUDA tensors (values checked, ms each), every
   strategy through ``rt.allreduce`` and through ``DistributedOptimizer`` (steps of the
   seed CNN on the GPU).
3. the device-to-device path of ring and ps: (a) the NCCL transport's batched send and
   receive (``dist.batch_isend_irecv``, the calls every ring/ps round makes) to this
   rank itself, 64 MB, checked and timed; (b) ``Ring`` and ``ParameterServer`` run for
   2-4 ranks as threads over an in-process lockstep channel on the GPU (NCCL's posting
   rules, GPU-to-GPU copies), results against a reference. Both run under the profiler:
   a device-to-host copy inside them is a failure.
4. with 2 or more GPUs: a 2-rank NCCL job, 64 MB allreduce with native, ring and ps
   (ms and busbw). With one GPU it is skipped: NCCL refuses two ranks on one device, so
   multi-rank GPU figures wait for a machine with several GPUs.

Exit status 1 when a check fails. Nothing here is run by the test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "sync"))  # the lockstep fake channel
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS: list[tuple[str, str, str]] = []


def check(name: str) -> Callable[[Callable[..., str]], Callable[..., None]]:
    """Run the function, record PASS (with the text it returns), FAIL or SKIP."""

    def wrap(fn: Callable[..., str]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            t0 = time.perf_counter()
            try:
                text = fn(*args)
                status = "SKIP" if text.startswith("skip:") else "PASS"
            except Exception as exc:  # noqa: BLE001 - report and go on with the next check
                status, text = "FAIL", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            RESULTS.append((status, name, text))
            print(f"[{status}] {name} ({time.perf_counter() - t0:.1f} s): {text}", flush=True)

        return run

    return wrap


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: Any, reps: int = 5) -> float:
    """Median seconds of ``fn`` (device work included)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _host_copies(fn: Callable[[], Any], device: Any) -> int:
    """Device-to-host copies the profiler sees while ``fn`` runs (0 on CPU)."""
    if device.type != "cuda":
        fn()
        return 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    return sum(1 for e in prof.events() if "DtoH" in e.name or "Device -> Pageable" in e.name)


# -- 1. loader -------------------------------------------------------------------------

@check("loader: pinned slots and H2D overlap")
def loader_check(device: Any) -> str:
    import torch

    from ringtrain.data import Loader

    if device.type != "cuda":
        return "skip: no CUDA device (pinned slots and side-stream copies are CUDA only)"
    images = torch.randint(0, 255, (2048, 3, 128, 128), dtype=torch.uint8)
    data = torch.utils.data.TensorDataset(images, torch.zeros(2048, dtype=torch.int64))
    weight = torch.randn(4096, 4096, device=device)

    def compute(x: Any) -> None:  # about as long as the copy of one batch
        for _ in range(6):
            weight.matmul(weight)
        x.float().mean()

    loader = Loader(data, batch_size=128, shuffle=False, num_workers=2, device=device)
    try:
        for x, _ in loader:  # first epoch: workers, slots, registration
            assert x.device.type == "cuda"
        stats = loader.stats()
        t0 = time.perf_counter()
        for _batch in loader:
            pass
        _sync(device)
        copy_only = time.perf_counter() - t0
        resident = next(iter(loader))[0]
        t0 = time.perf_counter()
        for _ in range(len(loader)):
            compute(resident)
        _sync(device)
        compute_only = time.perf_counter() - t0
        t0 = time.perf_counter()
        for x, _ in loader:
            compute(x)
        _sync(device)
        both = time.perf_counter() - t0
        h2d = loader.total_h2d_s
    finally:
        loader.close()
    if stats["pinned_slots"] < 1:
        raise AssertionError(f"no page-locked slots: {stats}")
    batch_mb = 128 * 3 * 128 * 128 / 2**20
    return (f"pinned slots {stats['pinned_slots']}, copied batches {stats['copied_batches']}, "
            f"fallback {stats.get('fallback_batches')}; epoch: copy only {copy_only * 1e3:.0f} ms, "
            f"compute only {compute_only * 1e3:.0f} ms, both {both * 1e3:.0f} ms, overlap "
            f"(copy + compute) / both = {(copy_only + compute_only) / both:.2f}; H2D device time "
            f"{h2d * 1e3:.0f} ms total ({len(loader) * batch_mb / max(h2d, 1e-9) / 1024:.1f} GB/s "
            f"over {len(loader)} batches of {batch_mb:.0f} MB, summed over the epochs run)")


# -- 2. a 1-rank NCCL job --------------------------------------------------------------

@check("1-rank NCCL job: every collective")
def collectives_check(device: Any) -> str:
    import torch

    import ringtrain as rt

    t = torch.arange(1 << 20, dtype=torch.float32, device=device)
    out = []
    ops: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: rt.allreduce(t, rt.Average),
        "allreduce_": lambda: rt.allreduce_(t.clone(), rt.Sum),
        "allreduce_async": lambda: rt.synchronize(rt.allreduce_async(t, rt.Max)),
        "allgather": lambda: rt.allgather(t),
        "broadcast": lambda: rt.broadcast(t, root_rank=0),
        "alltoall": lambda: rt.alltoall(t),
        "reducescatter": lambda: rt.reducescatter(t),
        "broadcast_object": lambda: rt.broadcast_object({"a": 1}, root_rank=0),
        "allgather_object": lambda: rt.allgather_object([1, 2]),
    }
    for name, fn in ops.items():
        got = fn()
        if isinstance(got, torch.Tensor):
            if got.device != t.device or not torch.equal(got, t):
                raise AssertionError(f"{name}: {got.device}, equal={torch.equal(got.cpu(), t.cpu())}")
        elif name == "broadcast_object" and got != {"a": 1} or name == "allgather_object" and got != [[1, 2]]:
            raise AssertionError(f"{name}: {got!r}")
        out.append(f"{name} {_timed(fn, device) * 1e3:.2f}")
    from ringtrain import runtime

    return f"backend {runtime.world().backend}, 4 MB tensors, ms: " + ", ".join(out)


@check("1-rank NCCL job: every strategy (rt.allreduce and DistributedOptimizer)")
def strategies_check(device: Any) -> str:
    import torch

    import ringtrain as rt
    from ringtrain import sync
    from ringtrain.plan.calibrate import mnist_cnn

    t = torch.randn(1 << 22, device=device)
    parts = []
    for name, alg in [("native", "native"), ("ring", "ring"), ("ps", "ps"),
                      ("ps k=1 object", sync.ParameterServer(servers=1))]:
        got = rt.allreduce(t, rt.Average, algorithm=alg)
        if got.device != t.device or not torch.equal(got, t):
            raise AssertionError(f"{name}: result differs or left the device")
        parts.append(f"{name} {_timed(lambda a=alg: rt.allreduce(t, rt.Average, algorithm=a), device) * 1e3:.2f} ms")
    x = torch.randn(64, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    for strategy in ("native", "ring", "ps"):
        torch.manual_seed(0)
        model = mnist_cnn().to(device)
        opt = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(), strategy=strategy)

        def step(opt: Any = opt, model: Any = model) -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        ms = _timed(step, device) * 1e3
        if not all(p.grad is not None and p.grad.device == device for p in model.parameters()):
            raise AssertionError(f"{strategy}: gradients missing or not on {device}")
        parts.append(f"CNN step with {strategy} {ms:.2f} ms")
    return "; ".join(parts)


# -- 3. device-to-device ring / ps -----------------------------------------------------

@check("NCCL transport: batched send/receive to self, on the device")
def transport_check(device: Any) -> str:
    import torch

    from ringtrain import runtime

    if device.type != "cuda" or runtime.world().backend != "nccl":
        return "skip: needs CUDA and the NCCL backend"
    from ringtrain.sync.channel import channel

    ch = channel(device)
    if not ch.lockstep or ch.device != device:
        raise AssertionError(f"expected the NCCL channel on {device}, got {type(ch.transport).__name__}")
    src = torch.randn(16 << 20, device=device)  # 64 MB
    dst = torch.empty_like(src)

    def round_trip() -> None:
        def job() -> None:
            sent, received = ch.start([(src, 0, 0)], [(dst, 0, 0)])
            for op in sent + received:
                op.wait()

        ch.submit(job, 60).result(60)

    copies = _host_copies(round_trip, device)
    if not torch.equal(src, dst):
        raise AssertionError("the received tensor differs from the sent one")
    if copies:
        raise AssertionError(f"{copies} device-to-host copies during the exchange")
    sec = _timed(round_trip, device)
    return (f"64 MB to self through dist.batch_isend_irecv on a side stream: {sec * 1e3:.2f} ms "
            f"({64 / 1024 / sec:.1f} GB/s), 0 device-to-host copies")


@check("ring and ps on device buffers (2-4 ranks as threads, lockstep channel)")
def d2d_algorithms_check(device: Any) -> str:
    import torch
    from sync_fakes import run_ranks

    from ringtrain.collectives import ReduceOp
    from ringtrain.sync import ParameterServer, Ring

    parts = []
    for n in (2, 3, 4):
        for alg in (Ring(), Ring(chunks_per_rank=3), ParameterServer(servers=1), ParameterServer(servers=n)):
            inputs = [torch.randn(1 << 18, device=device, generator=None) for _ in range(n)]
            want = torch.stack(inputs).mean(0)
            work = [x.clone() for x in inputs]
            box: dict[str, Any] = {}

            def go(a: Any = alg, w: list[Any] = work, b: dict[str, Any] = box, k: int = n) -> None:
                b["hub"] = run_ranks(k, lambda ch: a.exchange(w[ch.rank], ReduceOp.AVERAGE, ch),
                                     lockstep=True, device=device)[1]

            copies = _host_copies(go, device)
            for w in work:
                if w.device != device:
                    raise AssertionError(f"{alg!r} N={n}: result left {device}")
                torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)
            if copies:
                raise AssertionError(f"{alg!r} N={n}: {copies} device-to-host copies")
            parts.append(f"N={n} {alg!r}: {box['hub'].batches} batches")
    return "results equal the mean, no device-to-host copy; " + ", ".join(parts[:4]) + ", ..."


# -- 4. several GPUs -------------------------------------------------------------------

def _two_rank_job() -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import ringtrain as rt

    x = torch.randn(16 << 20, device=rt.device())  # 64 MB
    out = {}
    for alg in ("native", "ring", "ps"):
        rt.allreduce_(x, rt.Sum, algorithm=alg)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            rt.allreduce_(x, rt.Sum, algorithm=alg)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[alg] = statistics.median(times)
    return out


@check("2-rank NCCL job on 2 GPUs: 64 MB allreduce")
def multi_gpu_check(device: Any) -> str:
    import torch

    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return ("skip: one GPU here. NCCL refuses two ranks on one device, so multi-rank GPU "
                "figures (ring/ps between GPUs) wait for a machine with several GPUs")
    from local_job import spawn_world

    got = spawn_world(_two_rank_job, 2, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})[0]
    return ", ".join(f"{a} {s * 1e3:.2f} ms (busbw {64 / 1024 / s:.1f} GB/s)" for a, s in got.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="without CUDA: run what can run on the CPU (the script's own check)")
    args = p.parse_args(argv)
    import torch

    import ringtrain as rt

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_check: no CUDA device here; run it on a GPU machine (or --cpu-dry-run)", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    nccl = getattr(torch.cuda, "nccl", None)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device "
          f"{torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, "
          f"GPUs {torch.cuda.device_count()}, NCCL {nccl.version() if device.type == 'cuda' and nccl else '-'}",
          flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    loader_check(device)
    rt.init(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        collectives_check(device)
        strategies_check(device)
        transport_check(device)
        d2d_algorithms_check(device)
    finally:
        rt.shutdown()
    multi_gpu_check(device)
    failed = [name for status, name, _ in RESULTS if status == "FAIL"]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed or skipped"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
