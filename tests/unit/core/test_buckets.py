from __future__ import annotations

import torch

from ringtrain.buckets import plan_buckets

CPU = torch.device("cpu")


def test_buckets_fill_from_the_last_parameter_and_respect_the_size() -> None:
    shapes = [torch.Size([10])] * 5  # 40 bytes each in float32
    plan = plan_buckets(shapes, [torch.float32] * 5, [CPU] * 5, bucket_bytes=100)
    assert [b.params for b in plan] == [(4, 3), (2, 1), (0,)]
    assert [b.offsets for b in plan] == [(0, 10), (0, 10), (0,)]
    assert sum(b.numel for b in plan) == 50


def test_dtypes_never_share_a_bucket_and_big_tensors_stand_alone() -> None:
    shapes = [torch.Size([1000]), torch.Size([2]), torch.Size([2])]
    plan = plan_buckets(shapes, [torch.float32, torch.float16, torch.float32], [CPU] * 3, 64)
    assert {b.dtype for b in plan} == {torch.float32, torch.float16}
    for b in plan:
        assert all(
            (torch.float16 if i == 1 else torch.float32) == b.dtype for i in b.params
        )
    assert any(b.params == (0,) and b.numel == 1000 for b in plan)
