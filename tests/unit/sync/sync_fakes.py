"""An in-process fake of the p2p channel: N ranks as threads, messages through a hub.

It keeps the one property of Gloo the algorithms rely on: messages from one peer under
one tag are matched to receives in the order the receives were *posted* (FIFO), and a
receive of the wrong length is an error (Gloo aborts the process on it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ringtrain.sync._tensors import ScratchPool


class Hub:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.messages: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self.sent: dict[tuple[int, int, int], int] = {}
        self.posted: dict[tuple[int, int, int], int] = {}
        self.bytes_sent: dict[int, int] = {}
        self.bytes_received: dict[int, int] = {}


class _Done:
    def wait(self) -> None:
        return None


class _Recv:
    def __init__(self, hub: Hub, key: tuple[int, int, int, int], out: torch.Tensor, me: int) -> None:
        self.hub, self.key, self.out, self.me = hub, key, out, me

    def wait(self) -> None:
        with self.hub.cond:
            if not self.hub.cond.wait_for(lambda: self.key in self.hub.messages, timeout=20):
                raise TimeoutError(f"receive {self.key} never matched")
            data = self.hub.messages.pop(self.key)
        if data.numel() != self.out.numel():
            raise AssertionError(f"size mismatch on {self.key}: {data.numel()} vs {self.out.numel()}")
        self.out.copy_(data)
        self.hub.bytes_received[self.me] = self.hub.bytes_received.get(self.me, 0) + data.numel() * data.element_size()


class FakeChannel:
    def __init__(self, hub: Hub, rank: int, size: int) -> None:
        self.hub, self.rank, self.size = hub, rank, size
        self.scratch = ScratchPool()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> _Done:
        assert dst != self.rank, "a rank never sends to itself"
        with self.hub.cond:
            k = (self.rank, dst, tag)
            seq = self.hub.sent.get(k, 0)
            self.hub.sent[k] = seq + 1
            self.hub.messages[(*k, seq)] = tensor.detach().clone()
            self.hub.bytes_sent[self.rank] = self.hub.bytes_sent.get(self.rank, 0) + tensor.numel() * tensor.element_size()
            self.hub.cond.notify_all()
        return _Done()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> _Recv:
        assert src != self.rank, "a rank never receives from itself"
        with self.hub.cond:
            k = (src, self.rank, tag)
            seq = self.hub.posted.get(k, 0)  # matched at post time, like Gloo
            self.hub.posted[k] = seq + 1
        return _Recv(self.hub, (*k, seq), tensor, self.rank)


def run_ranks(n: int, fn: Callable[[FakeChannel], Any]) -> tuple[list[Any], Hub]:
    """Run ``fn(channel)`` for ranks 0..n-1 on threads; results by rank."""
    hub = Hub()
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = fn(FakeChannel(hub, r, n))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    assert not hub.messages, f"unreceived messages: {sorted(hub.messages)[:5]}"
    return results, hub
