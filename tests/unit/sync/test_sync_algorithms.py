"""Ring and parameter server, exchanged between threads through the fake channel.

Every correctness test runs on both fake transports: Gloo's (messages matched by tag,
receives posted early) and NCCL's (lockstep batches on one stream per rank, tags
ignored), so the device path's posting discipline is checked on CPU.
"""

from __future__ import annotations

import pytest
import torch
from sync_fakes import run_ranks

from ringtrain.collectives import ReduceOp
from ringtrain.sync import ParameterServer, Ring
from ringtrain.sync.ps import shard_plan
from ringtrain.sync.ring import auto_chunks, ring_schedule

OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX]


def _inputs(n: int, length: int, dtype: torch.dtype) -> list[torch.Tensor]:
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(97 * r + length)
        if dtype.is_floating_point:
            out.append(torch.randn(length, generator=g, dtype=torch.float64).to(dtype))
        else:
            out.append(torch.randint(-1000, 1000, (length,), generator=g, dtype=dtype))
    return out


def _expected(xs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    stack = torch.stack([x.double() for x in xs])
    if op is ReduceOp.MIN:
        return stack.min(0).values
    if op is ReduceOp.MAX:
        return stack.max(0).values
    total = stack.sum(0)
    if op is ReduceOp.AVERAGE:
        if xs[0].dtype.is_floating_point:
            return total / len(xs)
        # Integers truncate toward zero, as Horovod's C++ division (collectives.finish_average).
        return torch.div(torch.stack([x for x in xs]).sum(0), len(xs), rounding_mode="trunc").double()
    return total


def _tol(dtype: torch.dtype, n: int) -> float:
    return {torch.float16: 4e-3 * n, torch.bfloat16: 3e-2 * n, torch.float32: 1e-5}.get(dtype, 1e-12)


TRANSPORTS = pytest.mark.parametrize("lockstep", [False, True], ids=["gloo", "nccl-lockstep"])


def _run(strategy: Ring | ParameterServer, xs: list[torch.Tensor], op: ReduceOp,
         lockstep: bool = False):
    n = len(xs)
    work = [x.clone() for x in xs]

    def rank(ch):
        strategy.exchange(work[ch.rank], op, ch)
        return work[ch.rank]

    return run_ranks(n, rank, lockstep=lockstep)


@TRANSPORTS
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("length", [1, 2, 7, 64, 1001])
@pytest.mark.parametrize("chunks", [1, 3])
def test_ring_equals_reference_on_any_length(n: int, length: int, chunks: int, lockstep: bool) -> None:
    xs = _inputs(n, length, torch.float64)
    outs, _ = _run(Ring(chunks_per_rank=chunks), xs, ReduceOp.AVERAGE, lockstep)
    want = _expected(xs, ReduceOp.AVERAGE)
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(outs[0], o) for o in outs)  # every rank holds the same bytes


@TRANSPORTS
@pytest.mark.parametrize("n", [2, 3, 4, 6])
@pytest.mark.parametrize("servers", [1, 2, "n"])
@pytest.mark.parametrize("length", [1, 5, 333, 4096])
def test_ps_equals_reference_for_any_server_count(n: int, servers: int | str, length: int,
                                                   lockstep: bool) -> None:
    k = n if servers == "n" else min(int(servers), n)
    xs = _inputs(n, length, torch.float64)
    outs, _ = _run(ParameterServer(servers=k, chunks_per_rank=2), xs, ReduceOp.AVERAGE, lockstep)
    want = _expected(xs, ReduceOp.AVERAGE)
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(outs[0], o) for o in outs)


@pytest.mark.parametrize("strategy", [Ring(), Ring(chunks_per_rank=2), ParameterServer(),
                                      ParameterServer(servers=3)], ids=repr)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64], ids=str)
@TRANSPORTS
def test_every_op_and_dtype(strategy, op: ReduceOp, dtype: torch.dtype, lockstep: bool) -> None:
    n = 3
    xs = _inputs(n, 100, dtype)
    outs, _ = _run(strategy, xs, op, lockstep)
    want = _expected(xs, op)
    for out in outs:
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), want, rtol=_tol(dtype, n), atol=_tol(dtype, n))


@TRANSPORTS
@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_moves_2_n_minus_1_over_n_per_rank(n: int, lockstep: bool) -> None:
    length = 8 * 1024  # divisible by n: exact volumes
    outs, hub = _run(Ring(chunks_per_rank=2), _inputs(n, length, torch.float32), ReduceOp.SUM, lockstep)
    per_rank = length * 4 * 2 * (n - 1) / n
    assert all(hub.bytes_sent[r] == per_rank for r in range(n))
    assert all(hub.bytes_received[r] == per_rank for r in range(n))


@TRANSPORTS
@pytest.mark.parametrize("n", [2, 4, 8])
def test_single_server_carries_n_minus_1_times_the_buffer(n: int, lockstep: bool) -> None:
    nbytes = 4096 * 4
    _, hub = _run(ParameterServer(servers=1), _inputs(n, 4096, torch.float32), ReduceOp.SUM, lockstep)
    assert hub.bytes_received[0] == (n - 1) * nbytes  # the bottleneck grows with N
    assert hub.bytes_sent[0] == (n - 1) * nbytes
    assert all(hub.bytes_sent[w] == nbytes for w in range(1, n))
    _, hub_n = _run(ParameterServer(servers=n), _inputs(n, 4096, torch.float32), ReduceOp.SUM, lockstep)
    assert max(hub_n.bytes_sent.values()) <= 2 * (n - 1) / n * nbytes + 64 * n  # ~ the ring's


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_ring_schedule_matches_neighbours_and_covers_all_segments(n: int) -> None:
    schedules = [ring_schedule(n, r) for r in range(n)]
    assert all(len(s) == 2 * (n - 1) for s in schedules)
    for r in range(n):
        for t, (sent, _) in enumerate(schedules[r]):
            assert schedules[(r + 1) % n][t][1] == sent  # the right neighbour expects it
    # Simulate on symbolic sets: after reduce-scatter rank r owns segment r+1 complete.
    have = [[{r} for _ in range(n)] for r in range(n)]
    for t in range(2 * (n - 1)):
        msgs = [(schedules[r][t][0], set(have[r][schedules[r][t][0]])) for r in range(n)]
        for r in range(n):
            seg, contrib = msgs[(r - 1) % n]
            have[r][seg] = have[r][seg] | contrib if t < n - 1 else contrib
        if t == n - 2:
            assert all(have[r][(r + 1) % n] == set(range(n)) for r in range(n))
    assert all(have[r][s] == set(range(n)) for r in range(n) for s in range(n))


def test_shard_plan_splits_by_bytes_on_cache_lines() -> None:
    plan = shard_plan(numel=10_000, itemsize=4, servers=3, chunks=2)
    spans = [s for shard in plan for s in shard]
    assert sum(length for _, length in spans) == 10_000
    assert [s[0] for s in spans] == sorted(s[0] for s in spans)
    starts = [shard[0][0] for shard in plan]
    assert all(s * 4 % 64 == 0 for s in starts)
    sizes = [sum(length for _, length in shard) for shard in plan]
    assert max(sizes) - min(sizes) <= 16  # one 64-byte line of float32


def test_auto_chunks_keeps_pieces_large() -> None:
    assert auto_chunks(4 << 10) == 1
    assert auto_chunks(1 << 20) == 1
    assert auto_chunks(2 << 20) == 2
    assert auto_chunks(100 << 20) == 4
    # the ring's floor (2(N-1) rounds per piece)
    assert auto_chunks(4 << 20, 4 << 20) == 1
    assert auto_chunks(8 << 20, 4 << 20) == 2
    assert auto_chunks(64 << 20, 4 << 20) == 4
