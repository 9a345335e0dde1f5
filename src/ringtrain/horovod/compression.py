"""``hvd.Compression``: Horovod's two-method compressor interface, ringtrain's compressors.

``Compression.fp16.compress(t)`` returns ``(t as float16, ctx)`` for floating-point
tensors and ``t`` unchanged for others; ``decompress(t, ctx)`` restores the dtype.
"""

from __future__ import annotations

from ringtrain.compression import Compression, Compressor

__all__ = ["Compression", "Compressor"]
