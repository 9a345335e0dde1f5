"""Collectives whose ranks submit different tensors fail on every rank, clearly, and the
job can go on (issue: a bare collective with mismatched shapes returned a wrong answer
on one rank and crashed or aborted the other)."""

from __future__ import annotations

import pytest
import torch
from ringtest import run_world


def _call(case: str, rank: int, algorithm: str) -> None:
    import ringtrain as rt

    if case == "allreduce_shape":
        rt.allreduce(torch.ones(3 + rank), name="grad.w", algorithm=algorithm)
    elif case == "allreduce_dtype":
        rt.allreduce(torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64), name="loss",
                     algorithm=algorithm)
    elif case == "allreduce_op":
        rt.allreduce(torch.ones(3), op=rt.Sum if rank == 0 else rt.Max, name="x", algorithm=algorithm)
    elif case == "allreduce_algorithm":
        rt.allreduce(torch.ones(3), name="x", algorithm="native" if rank == 0 else "ring")
    elif case == "allgather_trailing":
        rt.allgather(torch.ones(2, 3 + rank), name="feats")
    elif case == "broadcast_shape":
        rt.broadcast(torch.ones(2, 2 + rank), root_rank=0, name="weights")
    elif case == "broadcast_root":
        rt.broadcast(torch.ones(2), root_rank=rank, name="weights")
    elif case == "alltoall_trailing":
        rt.alltoall(torch.ones(rt.size(), 2 + rank), name="tokens")
    elif case == "alltoall_bad_splits":
        rt.alltoall(torch.ones(4, 2), splits=[1, 1] if rank == 0 else [5, -1], name="tokens")
    elif case == "reducescatter_shape":
        rt.reducescatter(torch.ones(4 + 2 * rank), name="shard")
    elif case == "different_collectives":
        if rank == 0:
            rt.allreduce(torch.ones(2), name="a")
        else:
            rt.broadcast(torch.ones(2), root_rank=0, name="a")
    else:  # pragma: no cover
        raise AssertionError(case)


CASES = {
    # case: (error type, words every rank's message must contain)
    "allreduce_shape": ("MismatchError", ["allreduce tensor shapes", "'grad.w'", "(3,) float32 on rank 0",
                                          "(4,) float32 on rank 1"]),
    "allreduce_dtype": ("MismatchError", ["allreduce tensor dtypes", "float32 on rank 0", "float64 on rank 1"]),
    "allreduce_op": ("MismatchError", ["allreduce ops", "Sum on rank 0", "Max on rank 1"]),
    "allreduce_algorithm": ("MismatchError", ["allreduce algorithms", "native on rank 0", "ring on rank 1"]),
    "allgather_trailing": ("MismatchError", ["allgather tensor shapes", "(2, 3) float32 on rank 0",
                                             "first dimension"]),
    "broadcast_shape": ("MismatchError", ["broadcast tensor shapes", "'weights'"]),
    "broadcast_root": ("MismatchError", ["broadcast root ranks"]),
    "alltoall_trailing": ("MismatchError", ["alltoall tensor shapes", "'tokens'"]),
    "alltoall_bad_splits": ("ConfigError", ["rank 1: alltoall splits [5, -1]"]),
    "reducescatter_shape": ("MismatchError", ["reducescatter tensor shapes", "(4,) float32 on rank 0",
                                              "(6,) float32 on rank 1"]),
    "different_collectives": ("MismatchError", ["collective operations", "allreduce on rank 0",
                                                "broadcast on rank 1"]),
}


def _all_cases(algorithm: str) -> dict[str, str]:
    import ringtrain as rt

    out = {}
    cases = list(CASES)
    if algorithm != "native":  # the other collectives have no algorithm: run them once
        cases = [c for c in CASES if c.startswith("allreduce") and c != "allreduce_algorithm"]
    for case in cases:
        try:
            _call(case, rt.rank(), algorithm)
        except rt.errors.RingtrainError as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
        else:
            out[case] = "no error"
        # The failed call issued nothing: the world still works, in step.
        got = rt.allreduce(torch.full((2,), float(rt.rank())), op=rt.Sum, name="after", algorithm=algorithm)
        assert got.tolist() == [1.0, 1.0], (case, got)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["native", "ring", "ps"])
def test_mismatched_collectives_raise_the_same_clear_error_on_every_rank(algorithm: str) -> None:
    results = run_world(_all_cases, 2, algorithm, timeout=110)
    for case, text in results[0].items():
        error, words = CASES[case]
        for rank, per_rank in enumerate(results):
            message = per_rank[case]
            assert message.startswith(error), (case, rank, message)
            for w in words:
                assert w in message, (case, rank, w, message)
        assert results[1][case] == text, f"{case}: ranks worded the error differently"


def _matching() -> list[list[float]]:
    import ringtrain as rt

    r = rt.rank()
    return [
        rt.allgather(torch.full((r + 1, 2), float(r))).sum(0).tolist(),
        rt.alltoall(torch.arange(3.0) + 10 * r, splits=[1, 2] if r == 0 else [2, 1]).tolist(),
        rt.reducescatter(torch.arange(5.0) * (r + 1), op=rt.Sum).tolist(),
    ]


@pytest.mark.timeout(60)
def test_uneven_first_dimensions_still_work() -> None:
    r0, r1 = run_world(_matching, 2, timeout=50)
    assert r0[0] == r1[0] == [2.0, 2.0]  # rank 0: one row of 0s, rank 1: two rows of 1s
    assert r0[1] == [0.0, 10.0, 11.0] and r1[1] == [1.0, 2.0, 12.0]
    assert r0[2] == [0.0, 3.0, 6.0] and r1[2] == [9.0, 12.0]
