"""Before a collective runs, its ranks check that they submit matching tensors.

Gloo and NCCL trust their callers: an allreduce of a (3,) tensor on one rank and a
(4,) tensor on another returns garbage on one rank and crashes the other (or aborts the
process, for point-to-point rings). Horovod's coordinator refuses such a call on every
rank ("Mismatched allreduce tensor shapes"). ringtrain does the same with one small
exchange: every rank contributes a fixed-size integer *header* (which collective, the
op, the dtype, the shape, the root, the algorithm) through one small exchange, and every
rank compares all headers with the same rule (:func:`~.ranks.group_ranks`), so all of
them raise the same
:class:`~ringtrain.errors.MismatchError` or none does. Nothing of the real collective
has been issued by then, so the job can go on after the error.

The header also carries what the collective needs to know anyway (the first dimension
of each rank's allgather input, the alltoall splits), so allgather and alltoall cost no
extra round; allreduce, broadcast and reducescatter pay one small exchange. The fused
gradient exchange of the optimizers does not come through here: its layout is compared
once, at the first step (:mod:`ringtrain.agreement.signature`).

:func:`describe` is pure and unit-tested; :func:`agree` does the exchange.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtrain import inflight
from ringtrain.agreement.ranks import group_ranks, settle
from ringtrain.errors import ConfigError, MismatchError, ranks_phrase

__all__ = ["Header", "KINDS", "MAX_DIMS", "OPS", "agree", "describe", "encode", "decode", "op_code",
           "variant_code"]

#: Collectives that are checked, with their code in the header.
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
#: Reduce ops by code (0: none), named by ReduceOp's values.
OPS = ("", "average", "sum", "min", "max", "product", "adasum")
#: Dimensions carried verbatim; a tensor with more carries its first dimension and a
#: hash of the others (allgather and alltoall need the first; it may differ by rank).
MAX_DIMS = 8
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)
_FIXED = 7 + MAX_DIMS  # kind, op, dtype, ndim, root, variant, invalid, dims...


@dataclass(frozen=True)
class Header:
    """What one rank submits to a collective."""

    kind: str
    op: int  #: reduce op code (0 where there is none)
    dtype: str
    shape: tuple[int, ...] | None  #: None: more than MAX_DIMS dims (the rest compared by hash)
    ndim: int
    root: int  #: root rank of a broadcast (-1 where there is none)
    variant: int  #: the allreduce algorithm's identity (0 where there is none)
    invalid: bool  #: this rank's call is wrong on its own (bad splits, root, ...)
    dims_key: tuple[int, ...]  #: shape, or (first dim, hash of the rest) beyond MAX_DIMS: what is compared
    extra: tuple[int, ...] = ()  #: alltoall: the splits this rank sends

    @property
    def rows(self) -> int:
        """The first dimension (what allgather concatenates); 0 for a scalar."""
        return self.dims_key[0] if self.ndim else 0


def _code(dtype: torch.dtype) -> int:
    try:
        return _DTYPES.index(dtype)
    except ValueError:
        return 1000 + (zlib.crc32(str(dtype).encode()) % 1000)


def _dtype_name(code: int) -> str:
    if 0 <= code < len(_DTYPES):
        return str(_DTYPES[code]).replace("torch.", "")
    return f"dtype#{code}"


def op_code(value: str) -> int:
    """The header code of a reduce op given by its value (``"sum"``)."""
    return OPS.index(value)


def _op_name(code: int) -> str:
    return OPS[code].capitalize() if 0 < code < len(OPS) else f"op#{code}"


def variant_code(label: str) -> int:
    """A stable small integer for an algorithm's identity (its name and options)."""
    return zlib.crc32(label.encode()) & 0x7FFFFFFF


def encode(kind: str, tensor: torch.Tensor, op: int = 0, root: int = -1, variant: int = 0,
           extra: Sequence[int] = (), invalid: bool = False) -> list[int]:
    shape = list(tensor.shape)
    if len(shape) <= MAX_DIMS:
        dims = shape + [-1] * (MAX_DIMS - len(shape))
    else:
        # The first dimension verbatim (allgather and alltoall read it, and it may differ
        # by rank); before, the whole shape was hashed: a 9-d allgather returned nothing.
        dims = [shape[0], zlib.crc32(repr(shape[1:]).encode())] + [-1] * (MAX_DIMS - 2)
    return [KINDS.index(kind), op, _code(tensor.dtype), len(shape), root, variant, int(invalid),
            *dims, *extra]


def decode(row: Sequence[int]) -> Header:
    kind, op, dtype, ndim, root, variant, invalid = (int(v) for v in row[:7])
    dims = [int(v) for v in row[7:_FIXED]]
    shape = tuple(dims[:ndim]) if ndim <= MAX_DIMS else None
    key = shape if shape is not None else (dims[0], dims[1])
    return Header(KINDS[kind] if 0 <= kind < len(KINDS) else f"op#{kind}", op, _dtype_name(dtype),
                  shape, ndim, root, variant, bool(invalid), key, tuple(int(v) for v in row[_FIXED:]))


def _fmt(h: Header) -> str:
    shape = str(h.shape) if h.shape is not None else f"<{h.ndim} dims>"
    if h.shape is not None and len(h.shape) == 1:
        shape = f"({h.shape[0]},)"
    return f"{shape} {h.dtype}"


def _key(h: Header, kind: str) -> tuple[object, ...]:
    """The part of a header every rank must share for ``kind``."""
    if kind in ("allgather", "alltoall"):  # the first dimension may differ by rank
        return (h.kind, h.dtype, h.ndim, h.dims_key[1:])
    return (h.kind, h.op, h.dtype, h.dims_key, h.root, h.variant)


def describe(kind: str, headers: Sequence[Header], names: Sequence[str | None] | None = None,
             variants: Sequence[str | None] | None = None) -> str | None:
    """None when the ranks' headers agree for ``kind``; else the error message (the same
    on every rank, since every rank computes it from the same headers). ``names`` and
    ``variants`` (the algorithms' labels), by rank, only word the message."""
    ordered = group_ranks(headers, key=lambda h: _key(h, kind))
    if len(ordered) <= 1:
        return None
    label = ""
    if names is not None:
        distinct = sorted({n for n in names if n})
        label = f" of {distinct[0]!r}" if len(distinct) == 1 else (
            " of " + ", ".join(f"{n!r}" for n in distinct[:4]) if distinct else "")
    kinds = {h.kind for h in headers}
    if len(kinds) > 1:
        what = "collective operations"
        parts = [f"{headers[rs[0]].kind} on {ranks_phrase(rs)}" for rs in ordered]
        hint = "every rank must call the same collectives in the same order"
    elif len({h.dtype for h in headers}) > 1:
        what = f"{kind} tensor dtypes"
        parts = [f"{headers[rs[0]].dtype} on {ranks_phrase(rs)}" for rs in ordered]
        hint = "cast the tensor to one dtype on every rank"
    elif kind == "broadcast" and len({h.root for h in headers}) > 1:
        what = "broadcast root ranks"
        parts = [f"root {headers[rs[0]].root} on {ranks_phrase(rs)}" for rs in ordered]
        hint = "pass the same root_rank on every rank"
    elif len({h.op for h in headers}) > 1:
        what = f"{kind} ops"
        parts = [f"{_op_name(headers[rs[0]].op)} on {ranks_phrase(rs)}" for rs in ordered]
        hint = "pass the same op on every rank"
    elif len({h.variant for h in headers}) > 1:
        what = f"{kind} algorithms"
        parts = [f"{variants[rs[0]] if variants else '#' + str(headers[rs[0]].variant)} on {ranks_phrase(rs)}"
                 for rs in ordered]
        hint = "pass the same algorithm on every rank"
    else:
        what = f"{kind} tensor shapes"
        parts = [f"{_fmt(headers[rs[0]])} on {ranks_phrase(rs)}" for rs in ordered]
        hint = ("only the first dimension may differ between ranks"
                if kind in ("allgather", "alltoall") else "every rank must pass the same shape")
    return f"Mismatched {what}{label}: " + "; ".join(parts[:6]) + f" ({hint})"


def _sum_in_place(t: torch.Tensor) -> None:
    inflight.hold(t)
    dist.all_reduce(t)


def agree(kind: str, tensor: torch.Tensor, size: int, rank: int, name: str | None = None,
          op: int = 0, root: int = -1, variant: int = 0, extra: Sequence[int] = (),
          device: torch.device | None = None, problem: str | None = None,
          variant_label: str | None = None,
          exchange: Callable[[torch.Tensor], None] = _sum_in_place) -> list[Header]:
    """Exchange headers with every rank of the default group; raise MismatchError on
    every rank when they disagree, else return the headers by rank.

    ``problem``: what is wrong with this rank's call by itself (e.g. bad splits); every
    rank then raises a ConfigError naming the ranks and their problems, instead of the
    others waiting forever for a rank that gave up alone. ``device``: where the header
    travels (NCCL moves only CUDA tensors). ``exchange``: an in-place sum across ranks;
    the collectives pass one with the stall timeout, so a rank that never arrives is
    named instead of the others hanging in the check.
    """
    if len(extra) > size:
        raise ValueError(f"at most {size} extra header values, got {len(extra)}")
    # One row length for every kind (extra padded to `size`), so even ranks that call
    # different collectives exchange equal-sized headers and see the difference.
    row = encode(kind, tensor, op, root, variant, [*extra, *([0] * (size - len(extra)))],
                 invalid=problem is not None)
    # An all-gather written as a sum: each rank fills its own row of a zero table, so
    # the exchange can be any allreduce (in particular one that enforces the stall
    # timeout). int64 sums are exact.
    table = torch.zeros(size, len(row), dtype=torch.int64, device=device)
    table[rank] = torch.tensor(row, dtype=torch.int64, device=device)
    exchange(table.view(-1))
    headers = [decode(r) for r in table.tolist()]
    if any(h.invalid for h in headers):
        found = settle(problem, lambda mine: inflight.gather_objects(mine, device=device))
        # Ranks with the same problem are named together (each rank's copy said it again).
        groups = group_ranks(found)
        raise ConfigError("; ".join(f"{ranks_phrase(rs)}: {found[rs[0]]}" for rs in groups))
    if describe(kind, headers) is None:
        return headers
    # Everyone found the same mismatch: a second exchange for the names is safe.
    labels: list[tuple[str | None, str | None] | None] = inflight.gather_objects(
        (name, variant_label), device=device)
    names = [x[0] if x else None for x in labels]
    variants = [x[1] if x else None for x in labels]
    raise MismatchError(describe(kind, headers, names, variants) or f"Mismatched {kind} calls")
