"""Running a negotiated operation on its process group (the coordinator's thread only).

Every function gets this rank's request (``None`` on a rank that has joined: it
contributes zeros to sums and averages, the identity to min, max and product) and every
member's :class:`~.requests.Meta`, and runs the same collectives on every member in the
same order. Payloads of the operations that only move data (allgather, broadcast,
alltoall) travel as bytes, so every dtype works whatever the backend supports.
Reductions follow Horovod's arithmetic: integers are scaled in float64 and truncated
back, fp16 on the CPU is scaled in fp32, an integer average truncates toward zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import inflight
from ringtrain.horovod._coordinator.adasum import adasum_tree
from ringtrain.horovod._coordinator.requests import Meta

__all__ = ["Group", "Request", "allgather", "allreduce_fused", "alltoall", "broadcast",
           "reducescatter", "reducescatter_shares"]

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "average": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
              "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}


@dataclass
class Group:
    """Where a process set's operations run, as seen by this rank."""

    ranks: list[int]  #: global ranks of the members, sorted
    cpu: Any  #: process group for CPU tensors (Gloo)
    cuda: Any = None  #: process group for CUDA tensors (NCCL), when there is one

    def index(self, world_rank: int) -> int:
        return self.ranks.index(world_rank)


@dataclass
class Request:
    """This rank's side of one operation: the tensors, besides the meta."""

    meta: Meta
    tensor: torch.Tensor | None
    #: where the result goes (the input itself for in-place variants); None: allocate
    output: torch.Tensor | None = None
    #: CUDA: an event on the submitting thread's stream after ``tensor`` was written;
    #: the coordinator's stream waits for it before the operation reads the tensor
    ready: Any = None


#: Integer dtypes whose sum over a few ranks overflows long before their average does.
_NARROW_INTS = (torch.int8, torch.uint8, torch.int16)
#: Integer dtypes the backends cannot reduce (Gloo: "Invalid scalar type"; NCCL has no
#: 16-bit integers either), and the wider one they are reduced in. Narrowing back wraps
#: the sum and the product as arithmetic in the dtype itself would; min and max are exact.
_WIDEN = {torch.int16: torch.int32, torch.uint16: torch.int64, torch.uint32: torch.int64}


def _reduce_dtype(dtype: torch.dtype, op: str) -> tuple[torch.dtype, bool]:
    """The dtype a reduction travels in, and whether its result goes back to ``dtype``
    before the postscale (an average is divided in the wide dtype: the sum of two int8
    100s wrapped to -56 and averaged to -28; summed in int64, the average, which always
    fits the dtype, is exact)."""
    if op == "average" and (dtype in _NARROW_INTS or dtype in _WIDEN):
        return torch.int64, False
    if dtype in _WIDEN:
        return _WIDEN[dtype], True
    return dtype, False


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its lazy conjugate or negation applied: ``x.conj()`` and
    ``torch._neg_view`` views carry a bit instead of the values, which ``view(uint8)``
    refuses and a backend ignores. It failed on the rank holding such a view only, after
    the negotiation, so the other members waited in the backend for it."""
    return t.resolve_conj().resolve_neg()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def _device(meta: Meta, req: Request | None) -> torch.device:
    if req is not None and req.tensor is not None:
        return req.tensor.device
    return torch.device("cuda", torch.cuda.current_device()) if meta.device == "cuda" \
        else torch.device("cpu")


def _wire(group: Group, t: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The process group and the tensor to hand it (CUDA tensors go through the host
    when there is no NCCL group)."""
    if t.device.type == "cuda" and group.cuda is not None:
        return group.cuda, t
    return group.cpu, (t if t.device.type == "cpu" else t.cpu())


def _math_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.float64
    if dtype in (torch.float16, torch.bfloat16) and device.type == "cpu":
        return torch.float32
    return dtype


def _scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    if factor == 1.0:
        return t
    return (t.to(_math_dtype(t.dtype, t.device)) * factor).to(t.dtype)


def _finish(t: torch.Tensor, meta: Meta, set_size: int) -> torch.Tensor:
    if meta.op == "average" and set_size > 1:
        if t.dtype.is_floating_point or t.dtype.is_complex:
            if t.dtype in (torch.float16, torch.bfloat16) and t.device.type == "cpu":
                t = (t.float() / set_size).to(t.dtype)
            else:
                t = t / set_size
        else:
            # Horovod scales an integer sum once, by postscale/size in float64, and then
            # truncates: the average truncated first and then scaled differs
            # ([2, 6, 10, -4] instead of [3, 7, 11, -5] for postscale 2 on 2 ranks).
            return _scale(t, meta.postscale / set_size) if meta.postscale != 1.0 else \
                torch.div(t, set_size, rounding_mode="trunc")
    return _scale(t, meta.postscale)


def _deliver(req: Request | None, result: torch.Tensor) -> torch.Tensor | None:
    if req is None:
        return None
    if req.output is not None:
        with torch.no_grad():
            req.output.copy_(result.view_as(req.output))
        return req.output
    return result


def _absent(meta: Meta, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a rank that has joined contributes to an allreduce: zeros, as in Horovod, to a
    sum or an average (divided by the whole set's size, as Horovod's), and the identity
    of a min, max or product. Horovod's zeros there made the result 0 whenever the ranks
    with data had only positive values (min, product) or only negative ones (max): a
    wrong number, silently; the identity gives the result over the ranks with data."""
    if meta.op not in ("min", "max", "product"):
        return torch.zeros(meta.shape, dtype=dtype, device=device)
    if meta.op == "product" or dtype == torch.bool:
        return torch.full(meta.shape, meta.op != "max", dtype=dtype, device=device)
    if dtype.is_floating_point:
        extreme: float = float("inf") if meta.op == "min" else float("-inf")
    else:
        extreme = torch.iinfo(dtype).max if meta.op == "min" else torch.iinfo(dtype).min
    return torch.full(meta.shape, extreme, dtype=dtype, device=device)


def allreduce_fused(group: Group, metas: Sequence[Meta], reqs: Sequence[Request | None]) -> list[Any]:
    """One flat buffer for several same-dtype allreduces (Horovod's tensor fusion)."""
    first = metas[0]
    dtype = _dtype(first.dtype)
    device = _device(first, next((r for r in reqs if r is not None), None))
    parts = []
    for meta, req in zip(metas, reqs, strict=True):
        if req is None or req.tensor is None:
            parts.append(_absent(meta, dtype, device).reshape(-1))
        else:
            parts.append(_scale(_plain(req.tensor.detach()), meta.prescale).reshape(-1))
    size = len(group.ranks)
    if first.op == "adasum":
        results = [_adasum(group, p) for p in parts]
    else:
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        # (Horovod refuses these dtypes in allreduce; a wrapped sum is only what op=Sum
        # promises.)
        wide, narrow_back = _reduce_dtype(dtype, first.op)
        flat = flat.to(wide)
        pg, wire = _wire(group, flat)
        inflight.hold(wire)
        dist.all_reduce(wire, op=_TORCH_OPS[first.op], group=pg)
        if wire is not flat:
            flat.copy_(wire)
        if narrow_back:
            flat = flat.to(dtype)  # wrapped before the postscale, as in the dtype itself
        results, offset = [], 0
        for meta in metas:
            n = 1
            for d in meta.shape:
                n *= d
            results.append(flat[offset:offset + n])
            offset += n
    out: list[Any] = []
    for meta, req, res in zip(metas, reqs, results, strict=True):
        out.append(_deliver(req, _finish(res.reshape(meta.shape), meta, size).to(dtype)))
    return out


def _adasum(group: Group, flat: torch.Tensor) -> torch.Tensor:
    gathered = _gather_bytes(group, flat.reshape(-1), [flat.numel()] * len(group.ranks))
    return adasum_tree(gathered)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return _plain(t).contiguous().reshape(-1).view(torch.uint8)


def _gather_bytes(group: Group, t: torch.Tensor, rows: Sequence[int]) -> list[torch.Tensor]:
    """Every member's ``t`` (first dimensions ``rows``, by member), through bytes."""
    row_elems = 1
    for d in t.shape[1:]:
        row_elems *= d
    itemsize = t.element_size()
    longest = max(rows) if rows else 0
    mine = _as_bytes(t)
    pad = longest * row_elems * itemsize - mine.numel()
    if pad:
        mine = torch.cat([mine, torch.zeros(pad, dtype=torch.uint8, device=mine.device)])
    pg, wire = _wire(group, mine)
    bufs = [torch.empty_like(wire) for _ in group.ranks]
    inflight.hold(wire, *bufs)
    dist.all_gather(bufs, wire, group=pg)
    out = []
    for buf, n in zip(bufs, rows, strict=True):
        piece = buf[: n * row_elems * itemsize].to(t.device).view(t.dtype)
        out.append(piece.reshape((n, *t.shape[1:])))
    return out


def allgather(group: Group, metas_by_rank: dict[int, Meta], req: Request) -> torch.Tensor:
    assert req.tensor is not None
    t = req.tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    rows = [metas_by_rank[r].shape[0] if metas_by_rank[r].shape else 1 for r in group.ranks]
    return torch.cat(_gather_bytes(group, t, rows))


def broadcast(group: Group, root: int, req: Request) -> torch.Tensor:
    """``root``: the global rank (torch.distributed takes global ranks in groups too)."""
    assert req.tensor is not None
    src = req.tensor.detach()
    data = _as_bytes(src).clone()
    pg, wire = _wire(group, data)
    inflight.hold(wire)
    dist.broadcast(wire, src=root, group=pg)
    result = wire.to(src.device).view(src.dtype).reshape(src.shape)
    delivered = _deliver(req, result)
    assert delivered is not None
    return delivered


def alltoall(group: Group, metas_by_rank: dict[int, Meta], req: Request,
             world_rank: int) -> tuple[torch.Tensor, list[int]]:
    assert req.tensor is not None
    t = req.tensor.detach().contiguous()
    me = group.index(world_rank)
    send = list(req.meta.splits)
    recv = [metas_by_rank[r].splits[me] for r in group.ranks]
    row_bytes = t.element_size()
    for d in t.shape[1:]:
        row_bytes *= d
    data = _as_bytes(t)
    pg, wire = _wire(group, data)
    out = torch.empty(sum(recv) * row_bytes, dtype=torch.uint8, device=wire.device)
    inflight.hold(out, wire)
    dist.all_to_all_single(out, wire, output_split_sizes=[s * row_bytes for s in recv],
                           input_split_sizes=[s * row_bytes for s in send], group=pg)
    result = out.to(t.device).view(t.dtype).reshape((sum(recv), *t.shape[1:]))
    return result, recv


def reducescatter_shares(rows: int, parts: int) -> list[int]:
    """Rows per member: the first ``rows % parts`` members get one more."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def reducescatter(group: Group, req: Request | None, meta: Meta, world_rank: int) -> torch.Tensor | None:
    dtype = _dtype(meta.dtype)
    device = _device(meta, req)
    if req is None or req.tensor is None:
        t = torch.zeros(meta.shape, dtype=dtype, device=device)
    else:
        t = _scale(_plain(req.tensor.detach()), meta.prescale).contiguous()
    wide, narrow_back = _reduce_dtype(dtype, meta.op)  # as in allreduce_fused
    t = t.to(wide)
    shares = reducescatter_shares(meta.shape[0], len(group.ranks))
    pg, wire = _wire(group, t)
    pieces = [p.contiguous() for p in torch.split(wire, shares)]
    out = torch.empty_like(pieces[group.index(world_rank)])
    inflight.hold(out, *pieces)
    dist.reduce_scatter(out, pieces, op=_TORCH_OPS[meta.op], group=pg)
    out = out.to(dtype) if narrow_back else out
    result = _finish(out.to(t.device), meta, len(group.ranks)).to(dtype)
    return None if req is None else result
