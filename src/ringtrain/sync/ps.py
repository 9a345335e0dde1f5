"""ps: parameter server, with the servers being ranks of the job.

``servers=k`` ranks (0..k-1) each own one shard of every exchanged buffer, cut into k
parts of nearly equal bytes. Every rank pushes each shard to its owner; the owner adds
the N-1 incoming shards to its own, averages, and sends the result back to every rank.

- k = 1 is the article's single parameter server: that rank receives and sends
  (N-1) x the whole buffer, so its link is the bottleneck and the time grows with N.
- k = N is the sharded form (every rank serves 1/N): each rank moves 2(N-1)/N of the
  buffer, the same volume as the ring, in one hop instead of N-1.

Server ranks also train (they contribute their own gradient); dedicated server ranks
that only serve are not implemented (see docs/sync.md).

Shards are cut again into pieces (as in the ring) so the owner adds and returns piece p
while piece p+1 is still arriving. Results are computed once on the owner and sent to
all, so every rank ends with identical bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain.collectives import ReduceOp, finish_average
from ringtrain.errors import ConfigError
from ringtrain.sync._tensors import Span, aligned_spans, combine_, even_spans
from ringtrain.sync.base import P2PStrategy
from ringtrain.sync.channel import Channel
from ringtrain.sync.ring import auto_chunks

__all__ = ["ParameterServer", "shard_plan"]

# Tags: gradients to the owner, results back (apart from the ring's 0..chunks-1). Gloo
# matches one peer's messages FIFO per tag, and pieces travel in the same order on both
# sides, so one tag per direction is enough.
_PUSH, _PULL = 1 << 20, (1 << 20) + 1


def shard_plan(numel: int, itemsize: int, servers: int, chunks: int) -> list[list[Span]]:
    """pieces[server][p] = (start, length): shards of nearly equal bytes on 64-byte
    boundaries, each cut into ``chunks`` pieces. Pure, identical on every rank."""
    return [even_spans(length, chunks, start)
            for start, length in aligned_spans(numel, servers, itemsize)]


class ParameterServer(P2PStrategy):
    """Parameter server on ranks ``0..servers-1`` (default: one server, rank 0)."""

    name = "ps"
    options = {"stall_timeout": "stall_timeout", "ps_servers": "servers",
               "chunks_per_rank": "chunks_per_rank"}

    def __init__(
        self,
        servers: int = 1,
        chunks_per_rank: int | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        super().__init__(stall_timeout)
        if not isinstance(servers, int) or servers < 1:
            raise ConfigError(f"ps_servers must be an integer >= 1, got {servers!r}")
        if chunks_per_rank is not None and (not isinstance(chunks_per_rank, int) or chunks_per_rank < 1):
            raise ConfigError(f"chunks_per_rank must be an integer >= 1, got {chunks_per_rank!r}")
        self.servers = servers
        self.chunks_per_rank = chunks_per_rank

    def _options(self) -> dict[str, Any]:
        return {"ps_servers": self.servers, "chunks_per_rank": self.chunks_per_rank,
                **super()._options()}

    def check_world(self, size: int) -> None:
        if self.servers > size:
            raise ConfigError(
                f"ps_servers={self.servers} but the job has only {size} rank(s); "
                f"use 1 <= ps_servers <= {size}"
            )

    def exchange(self, flat: torch.Tensor, op: ReduceOp, ch: Channel) -> None:
        n, r, k = ch.size, ch.rank, self.servers
        if n == 1 or flat.numel() == 0:
            return  # nothing to exchange; an average over one rank is the value itself
        chunks = self.chunks_per_rank or auto_chunks(flat.numel() * flat.element_size() // k)
        plan = shard_plan(flat.numel(), flat.element_size(), k, chunks)
        sends: list[Any] = []
        pulls: list[Any] = []
        # As a worker: push every shard to its owner and post the receive of its result
        # into the same place (the result cannot arrive before our push was read).
        for owner in range(k):
            if owner == r:
                continue
            for start, length in plan[owner]:
                if length:
                    piece = flat[start : start + length]
                    sends.append(ch.send(piece, owner, _PUSH))
                    pulls.append(ch.recv(piece, owner, _PULL))
        if r < k:
            self._serve(flat, op, ch, plan[r], sends)
        for work in pulls:
            work.wait()
        for work in sends:
            work.wait()

    def _serve(self, flat: torch.Tensor, op: ReduceOp, ch: Channel, pieces: list[Span],
               sends: list[Any]) -> None:
        n, r = ch.size, ch.rank
        workers = [w for w in range(n) if w != r]
        shard_start = pieces[0][0]
        shard_len = sum(length for _, length in pieces)
        if shard_len == 0:
            return
        inbox = ch.scratch.get(flat.dtype, len(workers) * shard_len).view(len(workers), shard_len)
        posted = [[(ch.recv(inbox[i, s - shard_start : s - shard_start + ln], w, _PUSH)
                    if ln else None) for s, ln in pieces] for i, w in enumerate(workers)]
        for p, (start, length) in enumerate(pieces):
            if length == 0:
                continue
            own = flat[start : start + length]
            for i in range(len(workers)):  # rank order: the same sum on every run
                work = posted[i][p]
                assert work is not None
                work.wait()
                combine_(own, inbox[i, start - shard_start : start - shard_start + length], op)
            finish_average(own, op, n)
            for w in workers:
                sends.append(ch.send(own, w, _PULL))
