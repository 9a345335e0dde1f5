"""Gradient compression on the wire: Horovod's two-method compressor interface.

A compressor turns a tensor into what travels (``compress``) and back
(``decompress``). For the optimizer's fused buckets only the wire dtype matters:
fp16 and bf16 halve the bytes exchanged. fp16 keeps 11 significant bits and overflows
above 65504, so the optimizer scales by 1/P, P the power of two at or above the world
size, *before* the exchange (the order PyTorch's fp16 DDP hook uses); the sum still
overflows once the mean passes 65504 x P/N (docs/sync.md). bf16 keeps fp32's range with
8 bits.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Base: identity. Subclasses change :attr:`wire_dtype`."""

    name = "none"
    wire_dtype: torch.dtype | None = None

    def wire_dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        """What a tensor of ``dtype`` travels as (only floating tensors are compressed)."""
        if self.wire_dtype is None or not dtype.is_floating_point:
            return dtype
        return self.wire_dtype

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        wire = self.wire_dtype_for(tensor.dtype)
        return (tensor if wire == tensor.dtype else tensor.to(wire)), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class NoneCompressor(Compressor):
    pass


class FP16Compressor(Compressor):
    name = "fp16"
    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    name = "bf16"
    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors: ``Compression.none``, ``.fp16``, ``.bf16``."""

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16Compressor()
    bf16: Compressor = BF16Compressor()
