from __future__ import annotations

import torch

from ringtrain.fusion import plan_buckets

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


def test_first_bucket_is_small_and_megabyte_tensors_travel_alone() -> None:
    # Registration order as in the MNIST CNN: conv1, conv2, fc1 (4.7 MB), fc2.
    shapes = [torch.Size(s) for s in ([32, 1, 3, 3], [32], [64, 32, 3, 3], [64],
                                      [128, 9216], [128], [10, 128], [10])]
    plan = plan_buckets(shapes, [torch.float32] * 8, [CPU] * 8, bucket_bytes=25 * 2**20)
    # fc2 + fc1.bias are ready first and go at once; fc1.weight goes alone as soon as it
    # is ready, overlapping the convolutions' backward; the conv gradients go last.
    assert [b.params for b in plan] == [(7, 6, 5), (4,), (3, 2, 1, 0)]
