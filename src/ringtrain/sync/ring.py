"""ring: chunked ring-allreduce on point-to-point sends and receives.

The tensor is cut into N segments, one per rank. In N-1 reduce-scatter rounds each rank
sends one segment to its right neighbour and adds the segment arriving from its left,
so after them rank r holds segment r+1 summed over all ranks; N-1 allgather rounds then
pass the finished segments around. Each rank sends and receives 2(N-1)/N of the tensor
whatever N is (Patarasuk & Yuan 2009; Gibiansky 2017), which is why the exchange time
stays nearly flat as ranks are added while a single parameter server's grows with N.

Pipelining: every segment is cut again into ``chunks_per_rank`` pieces that go round
the ring independently, so the addition of one piece overlaps the transfer of the next,
and every round's send is posted together with the receive (on Gloo two receives in
flight per piece, double-buffered). Gloo matches messages from one peer first-in
first-out *per tag*, and pieces of different segments have different lengths, so piece
j travels under tag j: one FIFO per piece keeps the rounds of each piece in order. NCCL
ignores tags and matches in posting order; the rounds are posted in the same (round,
piece) order on every rank and in lockstep (a round's receive goes out with its send,
one batch), which keeps the per-peer order and cannot deadlock (see transport.py).

:func:`ring_schedule` (which segment goes where in each round) is pure and unit-tested.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ringtrain.collectives import ReduceOp, finish_average
from ringtrain.errors import ConfigError
from ringtrain.sync._tensors import Span, combine_, even_spans
from ringtrain.sync.base import P2PStrategy
from ringtrain.sync.channel import Channel, Msg

__all__ = ["Ring", "ring_schedule", "auto_chunks"]

# Pieces smaller than this gain nothing from pipelining on CPUs: each piece and round
# costs tens of microseconds of Python and Gloo overhead plus a thread wake-up, and
# 256 KB pieces measured slower than whole segments at 1-4 MB (2 ranks, Gloo, 2 cores).
_MIN_PIECE_BYTES = 1 << 20
# The ring's own floor is higher: it pays 2(N-1) rounds per piece, against the
# parameter server's two. Measured with 1, 2 and 4 pieces per segment (Gloo, 2 cores):
# 4 MB pieces were never slower than the best choice, 1 MB pieces were 11% slower than
# whole 4 MB segments at N = 4 (16 MB tensors), and whole segments beat 1 MB pieces at
# 4 MB, N = 2.
_RING_MIN_PIECE_BYTES = 4 << 20
_MAX_CHUNKS = 4


def ring_schedule(size: int, rank: int) -> list[tuple[int, int]]:
    """(segment sent to the right, segment received from the left) for each of the
    2(size-1) rounds: reduce-scatter rounds first, then allgather rounds."""
    out = []
    for t in range(size - 1):  # reduce-scatter: pass partial sums along
        out.append(((rank - t) % size, (rank - t - 1) % size))
    for t in range(size - 1):  # allgather: rank r starts with finished segment r+1
        out.append(((rank + 1 - t) % size, (rank - t) % size))
    return out


def auto_chunks(segment_bytes: int, min_piece: int = _MIN_PIECE_BYTES) -> int:
    """Pieces per segment: enough to pipeline, none smaller than ``min_piece``."""
    return max(1, min(_MAX_CHUNKS, segment_bytes // min_piece))


class Ring(P2PStrategy):
    """Ring-allreduce. ``chunks_per_rank``: pipeline pieces per segment (None: by size)."""

    name = "ring"
    options = {"stall_timeout": "stall_timeout", "chunks_per_rank": "chunks_per_rank"}

    def __init__(self, chunks_per_rank: int | None = None, stall_timeout: float | None = None) -> None:
        super().__init__(stall_timeout)
        if chunks_per_rank is not None and (not isinstance(chunks_per_rank, int) or chunks_per_rank < 1):
            raise ConfigError(f"chunks_per_rank must be an integer >= 1, got {chunks_per_rank!r}")
        self.chunks_per_rank = chunks_per_rank

    def _options(self) -> dict[str, Any]:
        return {"chunks_per_rank": self.chunks_per_rank, **super()._options()}

    def exchange(self, flat: torch.Tensor, op: ReduceOp, ch: Channel) -> None:
        n, r = ch.size, ch.rank
        if n == 1 or flat.numel() == 0:
            return  # nothing to exchange; an average over one rank is the value itself
        chunks = self.chunks_per_rank or auto_chunks(flat.numel() * flat.element_size() // n,
                                                     _RING_MIN_PIECE_BYTES)
        # pieces[segment][j] = (start, length) in flat; identical on every rank.
        pieces: list[list[Span]] = [even_spans(length, chunks, start)
                                    for start, length in even_spans(flat.numel(), n)]
        schedule = ring_schedule(n, r)
        rounds = len(schedule)
        reduce_rounds = n - 1
        right, left = (r + 1) % n, (r - 1) % n
        longest = max(length for seg in pieces for _, length in seg)
        # Receives in flight per piece: two where they may go out rounds early (Gloo,
        # double-buffered); one in lockstep (NCCL), posted with the round's send.
        ahead = 1 if ch.lockstep else 2
        # Two receive buffers per piece for the reduce-scatter rounds (allgather rounds
        # receive straight into place).
        scratch = ch.scratch.get(flat.dtype, 2 * chunks * longest).view(2, chunks, longest)
        sends: list[Any] = []
        inbox: list[deque[tuple[Any, torch.Tensor]]] = [deque() for _ in range(chunks)]

        def incoming(t: int, j: int) -> list[Msg]:
            if t >= rounds:
                return []
            start, length = pieces[schedule[t][1]][j]
            if length == 0:
                return []
            buf = scratch[t % 2, j, :length] if t < reduce_rounds else flat[start : start + length]
            return [(buf, left, j)]

        def outgoing(t: int, j: int) -> list[Msg]:
            if t >= rounds:
                return []
            start, length = pieces[schedule[t][0]][j]
            return [(flat[start : start + length], right, j)] if length else []

        def post(recvs: list[Msg], out: list[Msg], j: int) -> None:
            sent, received = ch.start(out, recvs)
            sends.extend(sent)
            inbox[j].extend(zip(received, [buf for buf, _, _ in recvs], strict=True))

        for j in range(chunks):
            post([m for t in range(ahead) for m in incoming(t, j)], outgoing(0, j), j)
        for t in range(rounds):
            for j in range(chunks):
                start, length = pieces[schedule[t][1]][j]
                if length:
                    work, buf = inbox[j].popleft()
                    work.wait()
                    if t < reduce_rounds:
                        target = flat[start : start + length]
                        combine_(target, buf, op)
                        if t == reduce_rounds - 1:
                            # This piece is now reduced over every rank: finish the average
                            # before it travels, so every rank gets the same bytes.
                            finish_average(target, op, n)
                # The receive reuses the buffer just consumed; in lockstep it goes out
                # with round t+1's send, as one batch.
                post(incoming(t + ahead, j), outgoing(t + 1, j), j)
        for work in sends:
            work.wait()
