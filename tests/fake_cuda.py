"""A fake CUDA device for the loader's device-path tests: each "DMA" happens only when
its event is queried as done, waited on, or handed to compute, like a real
asynchronous copy, so releasing a slot before its copy completes shows up as wrong data.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ringtrain.data.prefetch import tree_map

__all__ = ['FakeEvent', 'FakeBackend', 'Indexed']


class FakeEvent:
    def __init__(self, jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.jobs = jobs
        self.polls = 0
        self.complete = False

    def finish(self) -> None:
        if not self.complete:
            for dst, src in self.jobs:
                dst.copy_(src)  # the DMA happens now, reading the host memory as it is now
            self.complete = True


class FakeBackend:
    def __init__(self, lag: int = 3) -> None:
        self.lag = lag
        self.registered: dict[int, int] = {}
        self.copies = 0
        self.non_blocking: list[bool] = []

    def register(self, ptr: int, size: int) -> bool:
        self.registered[ptr] = size
        return True

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]

    def host_alloc(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def copy(self, host: Any, non_blocking: bool) -> tuple[Any, Any, Any]:
        jobs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def start(t: torch.Tensor) -> torch.Tensor:
            dst = torch.full_like(t, 0)
            jobs.append((dst, t))
            return dst

        dev = tree_map(start, host)
        ev = FakeEvent(jobs)
        self.copies += 1
        self.non_blocking.append(non_blocking)
        if not non_blocking:
            ev.finish()
        return dev, ev, ev

    def done(self, ev: FakeEvent) -> bool:
        ev.polls += 1
        if ev.polls > self.lag:
            ev.finish()
        return ev.complete

    def wait(self, ev: FakeEvent) -> None:
        ev.finish()

    def hand_over(self, batch: Any, ev: FakeEvent) -> None:
        ev.finish()  # compute waits for the copy

    def elapsed_s(self, start: Any, end: Any) -> float:
        return 0.001


class Indexed:
    def __init__(self, n: int) -> None:
        self.x = np.random.default_rng(0).standard_normal((n, 32)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], i
