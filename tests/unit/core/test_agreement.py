"""The pure half of the collective check: headers and the message every rank prints."""

from __future__ import annotations

import torch

from ringtrain.agreement import MAX_DIMS, decode, describe, encode, op_code


def _h(kind: str, t: torch.Tensor, **kw: object):  # type: ignore[no-untyped-def]
    return decode(encode(kind, t, **kw))  # type: ignore[arg-type]


def test_header_round_trip_keeps_what_is_compared() -> None:
    h = _h("allreduce", torch.zeros(2, 3, dtype=torch.float16), op=op_code("sum"), variant=7)
    assert (h.kind, h.shape, h.dtype, h.op, h.variant, h.root) == ("allreduce", (2, 3), "float16", 2, 7, -1)


def test_equal_headers_agree_and_allgather_ignores_the_first_dimension() -> None:
    same = [_h("allreduce", torch.zeros(4)) for _ in range(3)]
    assert describe("allreduce", same) is None
    gathered = [_h("allgather", torch.zeros(n, 5)) for n in (1, 2, 7)]
    assert describe("allgather", gathered) is None
    trailing = [_h("allgather", torch.zeros(1, 5)), _h("allgather", torch.zeros(1, 6))]
    assert "(1, 6) float32 on rank 1" in (describe("allgather", trailing) or "")


def test_message_groups_ranks_and_names_the_tensor() -> None:
    hs = [_h("allreduce", torch.zeros(3)), _h("allreduce", torch.zeros(4)), _h("allreduce", torch.zeros(3))]
    msg = describe("allreduce", hs, names=["w", "w", "w"])
    assert msg == ("Mismatched allreduce tensor shapes of 'w': (3,) float32 on ranks 0, 2; "
                   "(4,) float32 on rank 1 (every rank must pass the same shape)")


def test_shapes_beyond_max_dims_are_compared_by_hash() -> None:
    big = (1,) * (MAX_DIMS + 1)
    a = _h("allreduce", torch.zeros(big))
    b = _h("allreduce", torch.zeros((1,) * MAX_DIMS + (2,)))
    assert describe("allreduce", [a, a]) is None
    assert "tensor shapes" in (describe("allreduce", [a, b]) or "")


def test_dtype_and_root_and_kind_differences_have_their_own_words() -> None:
    f32, f64 = torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    assert "dtypes" in (describe("allreduce", [_h("allreduce", f32), _h("allreduce", f64)]) or "")
    roots = [_h("broadcast", f32, root=0), _h("broadcast", f32, root=1)]
    assert "root ranks" in (describe("broadcast", roots) or "")
    kinds = [_h("allreduce", f32), _h("broadcast", f32, root=0)]
    assert "allreduce on rank 0; broadcast on rank 1" in (describe("allreduce", kinds) or "")
