"""The allreduce measurement that runs on every rank of a job: native, ring, ps with 1
server and ps with N side by side, and the error of averaging with a compressed wire
dtype. Shared by allreduce.py (local jobs) and allreduce_shaped.py (one rank per shaped
network-namespace host).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["compression_errors", "measure", "measure_all"]


def _algorithm(name: str, n: int, link_mbps: float | None) -> Any:
    from ringtrain import sync

    if name == "native":
        return "native"
    kinds: dict[str, tuple[type, dict[str, int]]] = {
        "ring": (sync.Ring, {}),
        "ps1": (sync.ParameterServer, {"servers": 1}),
        "psN": (sync.ParameterServer, {"servers": n}),
    }
    cls, kw = kinds[name]
    if link_mbps:
        return _paced_class(cls)(link_mbps, **kw)
    return cls(**kw)


class _PacedChannel:
    """A channel whose links run at ``rate`` bytes/s per rank and direction.

    Egress: sends go through a pacing thread that releases each one when the rank's
    outgoing link would have finished transmitting it (the exchange thread does not
    block). Ingress: a completed receive is held until the rank's incoming link could
    have taken it, so N-1 workers sending to one server at once share its link. Time is
    spent sleeping, not computing, so the model measures traffic patterns, not copies.
    Host (Gloo) channels only: each message is posted on its own.
    """

    lockstep = False

    def __init__(self, inner: Any, rate: float) -> None:
        import queue as queue_mod
        import threading

        self.inner, self.rate = inner, rate
        self.rank, self.size, self.scratch = inner.rank, inner.size, inner.scratch
        self.device = inner.device
        self._out_free = 0.0
        self._in_free = 0.0
        self._queue: Any = queue_mod.SimpleQueue()
        threading.Thread(target=self._sender, daemon=True).start()

    def _sender(self) -> None:
        while True:
            msg, box, ready = self._queue.get()
            tensor = msg[0]
            now = time.perf_counter()
            self._out_free = max(now, self._out_free) + tensor.numel() * tensor.element_size() / self.rate
            time.sleep(max(0.0, self._out_free - now))
            box.append(self.inner.start([msg])[0][0])
            ready.set()

    def start(self, sends: Any = (), recvs: Any = ()) -> tuple[list[Any], list[Any]]:
        return [self._send(m) for m in sends], [self._recv(m) for m in recvs]

    def _send(self, msg: Any) -> Any:
        import threading

        box: list[Any] = []
        ready = threading.Event()
        self._queue.put((msg, box, ready))

        class Pending:
            def wait(self) -> None:
                ready.wait()
                box[0].wait()

        return Pending()

    def _recv(self, msg: Any) -> Any:
        op, channel, tensor = self.inner.start((), [msg])[1][0], self, msg[0]

        class Held:
            def wait(self) -> None:
                op.wait()
                now = time.perf_counter()
                done = max(now, channel._in_free + tensor.numel() * tensor.element_size() / channel.rate)
                channel._in_free = done
                time.sleep(max(0.0, done - now))

        return Held()


def _paced_class(cls: type) -> type:
    class Paced(cls):  # type: ignore[misc, valid-type]
        def __init__(self, link_mbps: float, **kw: Any) -> None:
            super().__init__(**kw)
            self._rate = link_mbps * 1e6
            self._channel: Any = None

        def exchange(self, flat: Any, op: Any, ch: Any) -> None:
            if self._channel is None or self._channel.inner is not ch:
                self._channel = _PacedChannel(ch, self._rate)
            super().exchange(flat, op, self._channel)

    Paced.__name__ = f"Paced{cls.__name__}"
    return Paced


def measure(sizes: list[int], algorithms: list[str], rounds: int, budget_s: float,
            link_mbps: float | None, warm_every_size: bool = True) -> list[dict[str, Any]]:
    """Records of every (size, algorithm) on this job's ranks (run on every rank).

    ``warm_every_size=False`` warms up (buffers, channel, connections) at the first size
    only: on slow links a warm-up of a 64 MB allreduce costs seconds per algorithm, and
    the pass that counts how many operations fit the budget warms each size anyway."""
    import torch
    import torch.distributed as dist

    import ringtrain as rt

    n = rt.size()
    algs = {name: _algorithm(name, n, link_mbps) for name in algorithms}
    records = []
    for index, nbytes in enumerate(sizes):
        x = torch.randn(nbytes // 4)
        times: dict[str, list[float]] = {name: [] for name in algorithms}
        for name in algorithms if warm_every_size or index == 0 else ():  # warm up
            rt.allreduce_(x, rt.Sum, algorithm=algs[name])
        iters = {}
        for name in algorithms:  # how many ops fit in the budget (same on every rank)
            dist.barrier()
            t0 = time.perf_counter()
            rt.allreduce_(x, rt.Sum, algorithm=algs[name])
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            iters[name] = int(max(1, min(50, budget_s / max(t.item(), 1e-6))))
        for _ in range(rounds):
            for name in algorithms:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters[name]):
                    rt.allreduce_(x, rt.Sum, algorithm=algs[name])
                t = torch.tensor([(time.perf_counter() - t0) / iters[name]], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
                times[name].append(t.item())
        for name in algorithms:
            sec = statistics.median(times[name])
            algbw = nbytes / sec / 1e9
            records.append({
                "n": n, "bytes": nbytes, "algorithm": name, "seconds": sec, "time_s": sec,
                "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n,
                # Interference from other processes only adds time: the best round
                # estimates the uncontended cost.
                "best_s": min(times[name]), "all_s": times[name],
                "rounds": len(times[name]), "iters": iters[name],
            })
    return records


def compression_errors(algorithms: list[str], numel: int = 1 << 20) -> list[dict[str, Any]]:
    """Error of averaging with fp16 / bf16 on the wire, against the exact (float64) mean.

    Done the way DistributedOptimizer does it: each rank scales its float32 gradient by
    1/N, narrows it to the wire dtype, the ranks Sum-allreduce in that dtype, and the
    result is widened back. Gradients: Gaussian, standard deviation 1e-2 (typical
    magnitudes), a different stream per rank.
    """
    import torch

    import ringtrain as rt

    n, r = rt.size(), rt.rank()
    g = torch.Generator().manual_seed(1234 + r)
    grad = torch.randn(numel, generator=g) * 1e-2
    exact = rt.allreduce(grad.double(), rt.Average)
    scale = exact.abs().max().item()
    out = []
    for name in algorithms:
        alg = _algorithm(name, n, None)
        for wire in (torch.float32, torch.float16, torch.bfloat16):
            t = (grad / n).to(wire)
            rt.allreduce_(t, rt.Sum, algorithm=alg)
            err = (t.double() - exact).abs()
            out.append({
                "n": n, "algorithm": name, "wire": str(wire).replace("torch.", ""),
                "max_abs_err_rel": err.max().item() / scale,  # relative to the largest value
                "rms_rel": (err.norm() / exact.norm()).item(),
            })
    return out


def measure_all(sizes: list[int], algorithms: list[str], rounds: int, budget_s: float,
                link_mbps: float | None) -> dict[str, Any]:
    records = measure(sizes, algorithms, rounds, budget_s, link_mbps)
    errors = [] if link_mbps else compression_errors(algorithms)
    return {"records": records, "compression": errors}
