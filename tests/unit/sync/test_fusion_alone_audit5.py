"""Fused exchange on one rank: nothing travels, so nothing is narrowed (audit 5).

Horovod registers no gradient hooks when ``size() == 1``, so a script run alone with
``compression=hvd.Compression.fp16`` steps on its exact gradients. Before the fix the
buckets were narrowed to fp16 all the same: 70000 came back inf, 1.2345678 as 1.234375.
"""

from __future__ import annotations

import pytest
import torch

from ringtrain.collectives import Average, Handle, ReduceOp, Sum
from ringtrain.compression import Compression, Compressor
from ringtrain.fusion import FusedExchange

GRAD = torch.tensor([1.2345678, 70000.0, 1e-7, -3.0])


def _alone(tensor: torch.Tensor, op: ReduceOp, name: str | None) -> Handle:
    return Handle(tensor, lambda: None, name)  # one rank: the sum is the tensor itself


@pytest.mark.parametrize("compression", [Compression.fp16, Compression.bf16], ids=repr)
@pytest.mark.parametrize("op", [Average, Sum], ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_rank_returns_the_exact_gradient(compression: Compressor, op: ReduceOp, dtype: torch.dtype) -> None:
    param = torch.zeros(4, dtype=dtype)
    fusion = FusedExchange(["w"], [param], _alone, compression, op, 1, 1 << 20)
    (bucket,) = fusion.buckets
    fusion.pack(bucket, [GRAD.to(dtype)])
    fusion.launch(bucket)
    fusion.wait(bucket)
    got = fusion.result(bucket, 0)
    assert got.dtype == dtype
    assert torch.equal(got, GRAD.to(dtype)), got


def test_two_ranks_still_narrow_on_the_wire() -> None:
    fusion = FusedExchange(["w"], [torch.zeros(4)], _alone, Compression.fp16, Average, 2, 1 << 20)
    assert fusion.buckets[0].flat.dtype == torch.float16
