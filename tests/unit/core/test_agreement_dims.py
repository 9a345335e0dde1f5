"""Headers of tensors with more dimensions than are carried verbatim keep the first one."""

from __future__ import annotations

import torch

from ringtrain.agreement import MAX_DIMS, decode, describe, encode


def _h(kind: str, shape: tuple[int, ...]):  # type: ignore[no-untyped-def]
    return decode(encode(kind, torch.zeros(shape)))


def test_first_dimension_of_a_deep_tensor_is_carried() -> None:
    rest = (1,) * MAX_DIMS
    assert [_h("allgather", (k, *rest)).rows for k in (0, 2, 5)] == [0, 2, 5]
    assert _h("allgather", ()).rows == 0 and _h("allgather", (4, 2)).rows == 4


def test_deep_allgather_may_differ_in_the_first_dimension_only() -> None:
    rest = (1,) * MAX_DIMS
    assert describe("allgather", [_h("allgather", (k, *rest)) for k in (1, 2, 3)]) is None
    assert describe("alltoall", [_h("alltoall", (k, *rest)) for k in (1, 2)]) is None
    other = (1,) * (MAX_DIMS - 1) + (2,)
    assert "tensor shapes" in (describe("allgather", [_h("allgather", (1, *rest)), _h("allgather", (1, *other))]) or "")
    assert "tensor shapes" in (describe("allreduce", [_h("allreduce", (1, *rest)), _h("allreduce", (2, *rest))]) or "")
