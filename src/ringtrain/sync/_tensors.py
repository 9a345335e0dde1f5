"""Small tensor helpers shared by the ring and the parameter server.

Pure arithmetic on index ranges (how a flat buffer is cut into pieces) lives here so it
is unit-tested without processes; the in-place combine applies a :class:`ReduceOp`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringtrain.collectives import ReduceOp

__all__ = ["Span", "even_spans", "aligned_spans", "combine_", "flat_work", "ScratchPool"]

#: (start, length) of a piece of a flat buffer, in elements.
Span = tuple[int, int]


def even_spans(length: int, parts: int, start: int = 0) -> list[Span]:
    """Cut ``length`` elements into ``parts`` contiguous spans; the first ``length % parts``
    spans get one extra element (the rule ``collectives`` uses for splits)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(length, parts)
    spans, offset = [], start
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        spans.append((offset, size))
        offset += size
    return spans


def aligned_spans(length: int, parts: int, itemsize: int, align_bytes: int = 64) -> list[Span]:
    """Cut ``length`` elements into ``parts`` spans of nearly equal *bytes*, with inner
    boundaries on ``align_bytes`` (a cache line), so shards of a bucket never share one."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    unit = max(1, align_bytes // max(1, itemsize))  # elements per aligned unit
    units = -(-length // unit)  # ceil
    spans, offset = [], 0
    for _, n_units in even_spans(units, parts):
        size = min(n_units * unit, length - offset)
        spans.append((offset, max(0, size)))
        offset += max(0, size)
    return spans


def combine_(dst: torch.Tensor, src: torch.Tensor, op: ReduceOp) -> None:
    """``dst = dst (op) src`` in place; Average sums here and divides once at the end."""
    if op is ReduceOp.SUM or op is ReduceOp.AVERAGE:
        dst.add_(src)
    elif op is ReduceOp.MIN:
        torch.minimum(dst, src, out=dst)
    elif op is ReduceOp.MAX:
        torch.maximum(dst, src, out=dst)
    else:  # pragma: no cover - torch_op() validated op before we got here
        raise ValueError(f"unsupported op {op!r}")


def flat_work(tensor: torch.Tensor, device: torch.device | str = "cpu"
              ) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A flat, contiguous tensor on ``device`` to exchange and a function writing it back
    (or None).

    ``device`` is the channel's: host memory for Gloo, the tensor's own GPU for NCCL. A
    contiguous tensor already there is used in place, with no copy: the only thing
    that differs between the host and the device path is where this buffer lives.
    Anything else (non-contiguous, or a CUDA tensor on a host channel) is staged and
    copied back when the exchange ends.
    """
    target = torch.device(device)
    if tensor.device == target and tensor.is_contiguous():
        return tensor.view(-1), None
    staged = tensor.detach().reshape(-1).to(target, copy=True)
    if tensor.device.type == "cuda" and target.type == "cpu":

        def back() -> None:
            tensor.copy_(staged.view(tensor.shape))
            torch.cuda.current_stream(tensor.device).synchronize()

        return staged, back

    def copy_back() -> None:
        tensor.copy_(staged.view(tensor.shape))

    return staged, copy_back


class ScratchPool:
    """Receive buffers reused across exchanges: one growing flat buffer per dtype, on
    the channel's device.

    Only the exchange thread uses it, so it needs no lock.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            self._buffers[dtype] = buf
        return buf[:numel]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
