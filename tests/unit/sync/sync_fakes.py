"""In-process fakes of the p2p channel: N ranks as threads, messages through a hub.

Two transports, as in ``ringtrain.sync.transport``:

- ``lockstep=False`` (Gloo): messages from one peer under one tag are matched to
  receives in the order the receives were *posted* (FIFO per tag); a send never waits.
- ``lockstep=True`` (NCCL): tags are ignored, messages between two ranks are matched in
  posting order, and each rank runs its batches one after the other, as NCCL's batches
  run on one stream: a message moves only while the batches of both its ends are the
  ones running, and a batch ends when all its messages moved. A receive posted ahead of
  its partner's batch therefore deadlocks here as it would on a GPU (the wait times out).

Either way a receive of the wrong length or dtype is an error (Gloo aborts the process on
it, NCCL corrupts memory), and every buffer handed to the channel must be on its device.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringtrain.sync._tensors import ScratchPool

Msg = tuple[torch.Tensor, int, int]
_WAIT_S = 20.0


class Hub:
    def __init__(self, lockstep: bool = False) -> None:
        self.lockstep = lockstep
        self.cond = threading.Condition()
        self.messages: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self.sent: dict[tuple[int, int, int], int] = {}
        self.posted: dict[tuple[int, int, int], int] = {}
        self.bytes_sent: dict[int, int] = {}
        self.bytes_received: dict[int, int] = {}
        self.batches = 0
        # lockstep: per rank, its batches in posting order (the head one is running).
        self.queues: dict[int, deque[_Batch]] = {}

    def count(self, me: int, sent: int = 0, received: int = 0) -> None:
        self.bytes_sent[me] = self.bytes_sent.get(me, 0) + sent
        self.bytes_received[me] = self.bytes_received.get(me, 0) + received


def _check(data: torch.Tensor, out: torch.Tensor, key: Any) -> None:
    if data.numel() != out.numel() or data.dtype != out.dtype:
        raise AssertionError(f"mismatch on {key}: {data.numel()} {data.dtype} vs {out.numel()} {out.dtype}")


class _Done:
    def wait(self) -> None:
        return None


class _Recv:
    def __init__(self, hub: Hub, key: tuple[int, int, int, int], out: torch.Tensor, me: int) -> None:
        self.hub, self.key, self.out, self.me = hub, key, out, me

    def wait(self) -> None:
        with self.hub.cond:
            if not self.hub.cond.wait_for(lambda: self.key in self.hub.messages, timeout=_WAIT_S):
                raise TimeoutError(f"receive {self.key} never matched")
            data = self.hub.messages.pop(self.key)
        _check(data, self.out, self.key)
        self.out.copy_(data)
        self.hub.count(self.me, received=data.numel() * data.element_size())


class _Batch:
    """lockstep: one batch of one rank; ``ops`` are [kind, peer, seq, tensor, moved]."""

    def __init__(self, rank: int, ops: list[list[Any]]) -> None:
        self.rank = rank
        self.ops = ops
        self.done = False


class _BatchOp:
    def __init__(self, hub: Hub, batch: _Batch) -> None:
        self.hub, self.batch = hub, batch

    def wait(self) -> None:
        with self.hub.cond:
            if not self.hub.cond.wait_for(lambda: self.batch.done, timeout=_WAIT_S):
                raise TimeoutError(f"rank {self.batch.rank}: batch never finished (deadlock)")


def _progress(hub: Hub) -> None:
    """lockstep: move every message whose two ends are in running batches (hub.cond held)."""
    changed = True
    while changed:
        changed = False
        heads = {r: q[0] for r, q in hub.queues.items() if q}
        for rank, batch in heads.items():
            for op in batch.ops:
                kind, peer, seq, tensor, moved = op
                if moved or kind != "send":
                    continue
                other = heads.get(peer)
                if other is None:
                    continue
                for mate in other.ops:
                    if mate[0] == "recv" and mate[1] == rank and mate[2] == seq and not mate[4]:
                        _check(tensor, mate[3], (rank, peer, seq))
                        mate[3].copy_(tensor)
                        nbytes = tensor.numel() * tensor.element_size()
                        hub.count(rank, sent=nbytes)
                        hub.count(peer, received=nbytes)
                        op[4] = mate[4] = True
                        changed = True
        for rank, batch in heads.items():
            if all(op[4] for op in batch.ops):
                batch.done = True
                hub.queues[rank].popleft()
                changed = True
    hub.cond.notify_all()


class FakeChannel:
    def __init__(self, hub: Hub, rank: int, size: int, device: torch.device | str = "cpu") -> None:
        self.hub, self.rank, self.size = hub, rank, size
        self.device = torch.device(device)
        self.lockstep = hub.lockstep
        self.scratch = ScratchPool(self.device)

    def start(self, sends: Sequence[Msg] = (), recvs: Sequence[Msg] = ()) -> tuple[list[Any], list[Any]]:
        for t, peer, _ in [*sends, *recvs]:
            assert peer != self.rank, "a rank never sends to or receives from itself"
            assert t.device == self.device, f"a buffer on {t.device}, the channel is on {self.device}"
        if self.hub.lockstep:
            return self._batch(sends, recvs)
        received = [self._recv(t, src, tag) for t, src, tag in recvs]
        sent = [self._send(t, dst, tag) for t, dst, tag in sends]
        return sent, received

    def _batch(self, sends: Sequence[Msg], recvs: Sequence[Msg]) -> tuple[list[Any], list[Any]]:
        if not sends and not recvs:
            return [], []
        hub = self.hub
        with hub.cond:
            ops: list[list[Any]] = []
            for kind, msgs, counter in (("recv", recvs, hub.posted), ("send", sends, hub.sent)):
                for t, peer, _ in msgs:  # tags are ignored, as NCCL does
                    key = (peer, self.rank, 0) if kind == "recv" else (self.rank, peer, 0)
                    seq = counter.get(key, 0)
                    counter[key] = seq + 1
                    ops.append([kind, peer, seq, t.detach() if kind == "send" else t, False])
            batch = _Batch(self.rank, ops)
            hub.queues.setdefault(self.rank, deque()).append(batch)
            hub.batches += 1
            _progress(hub)
        op = _BatchOp(hub, batch)
        return [op] * len(sends), [op] * len(recvs)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> _Done:
        with self.hub.cond:
            k = (self.rank, dst, tag)
            seq = self.hub.sent.get(k, 0)
            self.hub.sent[k] = seq + 1
            self.hub.messages[(*k, seq)] = tensor.detach().clone()
            self.hub.count(self.rank, sent=tensor.numel() * tensor.element_size())
            self.hub.cond.notify_all()
        return _Done()

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> _Recv:
        with self.hub.cond:
            k = (src, self.rank, tag)
            seq = self.hub.posted.get(k, 0)  # matched at post time, like Gloo
            self.hub.posted[k] = seq + 1
        return _Recv(self.hub, (*k, seq), tensor, self.rank)


def run_ranks(n: int, fn: Callable[[FakeChannel], Any], lockstep: bool = False,
              device: torch.device | str = "cpu") -> tuple[list[Any], Hub]:
    """Run ``fn(channel)`` for ranks 0..n-1 on threads; results by rank."""
    hub = Hub(lockstep)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = fn(FakeChannel(hub, r, n, device))
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
    assert not any(hub.queues.values()), "batches left unfinished"
    return results, hub
