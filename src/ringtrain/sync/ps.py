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
all, so every rank ends with identical bytes. On Gloo every push and every result's
receive is posted at once (matched by tag); on NCCL (lockstep, see transport.py) each
piece is two rounds, "push piece p" then "pull piece p", in the same order on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain.collectives import ReduceOp, finish_average
from ringtrain.errors import ConfigError
from ringtrain.sync._tensors import Span, aligned_spans, combine_, even_spans
from ringtrain.sync.base import P2PStrategy
from ringtrain.sync.channel import Channel, Msg
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
        owners = [o for o in range(k) if o != r]
        workers = [w for w in range(n) if w != r]
        serving = r < k and sum(length for _, length in plan[r]) > 0
        shard_start = plan[r][0][0] if r < k else 0
        shard_len = sum(length for _, length in plan[r]) if r < k else 0
        # The incoming pushes of this rank's shard, one row per worker (in rank order).
        inbox = (ch.scratch.get(flat.dtype, len(workers) * shard_len).view(len(workers), shard_len)
                 if serving else None)

        def piece(owner: int, p: int) -> torch.Tensor:
            start, length = plan[owner][p]
            return flat[start : start + length]

        def pushes_out(p: int) -> list[Msg]:  # this rank's piece p of every other shard
            return [(piece(o, p), o, _PUSH) for o in owners if plan[o][p][1]]

        def pushes_in(p: int) -> list[Msg]:  # every worker's piece p of this rank's shard
            if inbox is None or plan[r][p][1] == 0:
                return []
            start, length = plan[r][p]
            lo = start - shard_start
            return [(inbox[i, lo : lo + length], w, _PUSH) for i, w in enumerate(workers)]

        def pulls_out(p: int) -> list[Msg]:  # the finished piece p of this shard, to all
            return [(piece(r, p), w, _PULL) for w in workers] if serving and plan[r][p][1] else []

        def pulls_in(p: int) -> list[Msg]:  # the finished piece p of every other shard,
            return [(piece(o, p), o, _PULL) for o in owners if plan[o][p][1]]  # in place

        sends: list[Any] = []
        waits: list[Any] = []
        arrived: list[list[Any]] = [[] for _ in range(chunks)]
        if not ch.lockstep:
            # Gloo: everything that can go out now does. A worker's result is received
            # into the place it was pushed from (it cannot arrive before the push was read).
            for p in range(chunks):
                sent, received = ch.start(pushes_out(p), pulls_in(p))
                sends += sent
                waits += received
                arrived[p] = ch.start((), pushes_in(p))[1]
        for p in range(chunks):
            if ch.lockstep:  # NCCL: round "push piece p", then round "pull piece p"
                sent, arrived[p] = ch.start(pushes_out(p), pushes_in(p))
                sends += sent
            if serving and plan[r][p][1]:
                self._reduce_piece(piece(r, p), arrived[p], inbox, plan[r][p][0] - shard_start, op, n)
            if ch.lockstep:
                sent, received = ch.start(pulls_out(p), pulls_in(p))
                waits += received
            else:
                sent = ch.start(pulls_out(p))[0]
            sends += sent
        for work in waits:
            work.wait()
        for work in sends:
            work.wait()

    @staticmethod
    def _reduce_piece(own: torch.Tensor, arrived: list[Any], inbox: torch.Tensor | None, lo: int,
                      op: ReduceOp, n: int) -> None:
        """Add every worker's copy of one piece to this rank's own, then finish the op."""
        assert inbox is not None  # only servers reduce
        for i, work in enumerate(arrived):  # rank order: the same sum on every run
            work.wait()
            combine_(own, inbox[i, lo : lo + own.numel()], op)
        finish_average(own, op, n)
