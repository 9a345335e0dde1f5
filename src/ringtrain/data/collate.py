"""Collate samples into a batch, writing straight into memory the caller provides.

``default_collate(samples, alloc)`` follows torch's rules (tensors, ndarrays and
numbers become tensors stacked along a new first dimension; tuples, lists and dicts
are collated field by field; strings and other objects are passed through as lists),
but every numeric field is written by one ``stack(..., out=...)`` into a buffer that
``alloc(nbytes)`` returns. In a loader worker ``alloc`` hands out pieces of a reused
shared-memory slot, so the batch is built in place: no intermediate tensors, no
pickling of array data.

A batch travels as a *spec*: a tree of builtin tuples whose array leaves are
``(offset, nbytes, dtype name, shape, kind)`` records into a byte buffer.
:func:`pack` turns any batch (also one from a user's ``collate_fn``) into a spec,
copying only leaves that are not in the buffer yet; :func:`unpack` rebuilds the batch
as views of a buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ringtrain.errors import DataError

__all__ = [
    "Alloc",
    "Arena",
    "SlotFull",
    "default_collate",
    "fresh_alloc",
    "pack",
    "unpack",
    "spec_nbytes",
]

#: ``alloc(nbytes) -> np.ndarray`` of ``nbytes`` uint8, 64-byte aligned when possible.
Alloc = Callable[[int], np.ndarray]

ALIGN = 64  # a cache line: keeps every field's rows aligned for vectorised copies

# torch dtype <-> numpy dtype (only those both libraries have); others travel as bytes.
_TORCH_TO_NP: dict[torch.dtype, np.dtype] = {}
for _dt in (torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
            torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
            torch.bool, torch.complex64, torch.complex128):
    _TORCH_TO_NP[_dt] = torch.empty(0, dtype=_dt).numpy().dtype
_NP_TO_TORCH = {v: k for k, v in _TORCH_TO_NP.items()}
_TORCH_BY_NAME = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                  if isinstance(d, torch.dtype)}


class SlotFull(Exception):
    """Internal: the batch does not fit the buffer; the worker falls back."""


def fresh_alloc(nbytes: int) -> np.ndarray:
    """An allocator for in-process loading: a new array per field."""
    return np.empty(nbytes, dtype=np.uint8)


class Arena:
    """A bump allocator over one byte buffer (a shared-memory slot or a private one)."""

    __slots__ = ("buf", "base", "end", "used")

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.base = buf.ctypes.data
        self.end = self.base + buf.nbytes
        self.used = 0

    def alloc(self, nbytes: int) -> np.ndarray:
        start = self.used
        stop = start + nbytes
        if stop > self.buf.nbytes:
            raise SlotFull(stop)
        self.used = -(-stop // ALIGN) * ALIGN
        return self.buf[start:stop]

    def offset_of(self, ptr: int, nbytes: int) -> int:
        """Offset of ``ptr`` when ``[ptr, ptr+nbytes)`` lies inside this buffer, else -1."""
        return ptr - self.base if self.base <= ptr and ptr + nbytes <= self.end else -1


# ---- collate -------------------------------------------------------------------------
def _torch_out(buf: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    np_dtype = _TORCH_TO_NP.get(dtype)
    if np_dtype is not None:
        return torch.from_numpy(buf.view(np_dtype).reshape(shape))
    return torch.from_numpy(buf).view(dtype).reshape(shape)


def _shape_error(what: str, samples: Sequence[Any], err: Exception) -> DataError:
    shapes = sorted({tuple(s.shape) for s in samples})[:4]
    return DataError(
        f"cannot stack {what} of different shapes {shapes} into one batch ({err}); "
        "pad or resize them in the dataset, or pass a collate_fn"
    )


def default_collate(samples: Sequence[Any], alloc: Alloc = fresh_alloc) -> Any:
    """Collate a list of samples into a batch whose arrays are written via ``alloc``."""
    elem = samples[0]
    n = len(samples)
    if isinstance(elem, torch.Tensor):
        nbytes = n * elem.numel() * elem.element_size()
        out = _torch_out(alloc(nbytes), elem.dtype, (n, *elem.shape))
        try:
            torch.stack(samples, out=out)  # type: ignore[arg-type]
        except RuntimeError as err:
            if any(s.shape != elem.shape for s in samples):
                raise _shape_error("tensors", samples, err) from None
            raise
        return out
    if isinstance(elem, np.ndarray) and elem.dtype in _NP_TO_TORCH:
        arr = alloc(n * elem.nbytes).view(elem.dtype).reshape((n, *elem.shape))
        try:
            np.stack(samples, out=arr)  # type: ignore[call-overload]
        except ValueError as err:
            raise _shape_error("arrays", samples, err) from None
        return torch.from_numpy(arr)
    if isinstance(elem, (bool, np.bool_)):
        return _numbers(samples, np.dtype(np.bool_), alloc)
    if isinstance(elem, (int, np.integer)):
        return _numbers(samples, np.dtype(np.int64) if isinstance(elem, int) else elem.dtype, alloc)
    if isinstance(elem, (float, np.floating)):
        return _numbers(samples, np.dtype(np.float64) if isinstance(elem, float) else elem.dtype,
                        alloc)
    if isinstance(elem, (str, bytes)):
        return list(samples)
    if isinstance(elem, Mapping):
        try:
            return {key: default_collate([s[key] for s in samples], alloc) for key in elem}
        except KeyError as err:
            raise DataError(f"samples in a batch have different keys (missing {err}); "
                            "give every sample the same keys") from None
    if isinstance(elem, (tuple, list)):
        size = len(elem)
        if any(len(s) != size for s in samples):
            raise DataError(f"samples in a batch have different lengths (first has {size}); "
                            "return the same number of fields from every __getitem__")
        fields = [default_collate(f, alloc) for f in zip(*samples)]
        if isinstance(elem, tuple) and hasattr(elem, "_fields"):  # namedtuple
            return type(elem)(*fields)
        return tuple(fields) if isinstance(elem, tuple) else fields
    return list(samples)  # None and other objects: passed through, as torch does


def _numbers(samples: Sequence[Any], dtype: np.dtype, alloc: Alloc) -> torch.Tensor:
    arr = alloc(len(samples) * dtype.itemsize).view(dtype)
    arr[:] = samples
    return torch.from_numpy(arr)


# A list is described element by element only when it holds arrays or containers; a
# list of strings or other objects (the default collate's pass-through) travels whole.
_CONTAINERS = (torch.Tensor, np.ndarray, tuple, list, dict)


# ---- spec: how a batch travels -------------------------------------------------------
# Leaves: ("a", offset, nbytes, dtype name, shape, is_torch); ("o", obj).
# Nodes:  ("t", children), ("l", children), ("d", keys, children), ("n", cls, children).
def pack(batch: Any, arena: Arena) -> tuple:
    """Describe ``batch`` as a spec over ``arena``'s buffer, copying leaves not in it."""
    if isinstance(batch, torch.Tensor):
        t = batch.detach()
        if t.device.type != "cpu":
            raise DataError(f"a collated batch holds a tensor on {t.device}; "
                            "keep worker outputs on the CPU (the loader moves them)")
        nbytes = t.numel() * t.element_size()
        off = arena.offset_of(t.data_ptr(), nbytes) if t.is_contiguous() else -1
        if off < 0:
            buf = arena.alloc(nbytes)
            _torch_out(buf, t.dtype, t.shape).copy_(t)
            off = buf.ctypes.data - arena.base
        return ("a", off, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape), True)
    if isinstance(batch, np.ndarray) and batch.dtype in _NP_TO_TORCH:
        nbytes = batch.nbytes
        off = (arena.offset_of(batch.ctypes.data, nbytes)
               if batch.flags.c_contiguous else -1)
        if off < 0:
            buf = arena.alloc(nbytes)
            np.copyto(buf.view(batch.dtype).reshape(batch.shape), batch)
            off = buf.ctypes.data - arena.base
        return ("a", off, nbytes, batch.dtype.str, batch.shape, False)
    if type(batch) is dict:
        return ("d", tuple(batch), tuple(pack(v, arena) for v in batch.values()))
    if isinstance(batch, tuple):
        children = tuple(pack(v, arena) for v in batch)
        if hasattr(batch, "_fields"):
            return ("n", type(batch), children)
        return ("t", children)
    if type(batch) is list and batch and isinstance(batch[0], _CONTAINERS):
        return ("l", tuple(pack(v, arena) for v in batch))
    return ("o", batch)


def spec_nbytes(batch: Any) -> int:
    """Bytes (with alignment) :func:`pack` needs for ``batch`` in an empty arena."""
    if isinstance(batch, torch.Tensor):
        return -(-batch.numel() * batch.element_size() // ALIGN) * ALIGN
    if isinstance(batch, np.ndarray) and batch.dtype in _NP_TO_TORCH:
        return -(-batch.nbytes // ALIGN) * ALIGN
    if type(batch) is dict:
        return sum(spec_nbytes(v) for v in batch.values())
    if isinstance(batch, tuple) or (type(batch) is list and batch
                                    and isinstance(batch[0], _CONTAINERS)):
        return sum(spec_nbytes(v) for v in batch)
    return 0


def unpack(spec: tuple, buf: np.ndarray, copy: bool = False) -> Any:
    """Rebuild a batch from ``spec`` as views of ``buf`` (or copies when ``copy``)."""
    kind = spec[0]
    if kind == "a":
        _, off, nbytes, dtype_name, shape, is_torch = spec
        raw = buf[off:off + nbytes]
        if not is_torch:
            arr = raw.view(np.dtype(dtype_name)).reshape(shape)
            return arr.copy() if copy else arr
        dtype = _TORCH_BY_NAME[dtype_name]
        if copy:
            raw = raw.copy()
        return _torch_out(raw, dtype, shape)
    if kind == "t":
        return tuple(unpack(c, buf, copy) for c in spec[1])
    if kind == "l":
        return [unpack(c, buf, copy) for c in spec[1]]
    if kind == "d":
        return {k: unpack(c, buf, copy) for k, c in zip(spec[1], spec[2])}
    if kind == "n":
        return spec[1](*(unpack(c, buf, copy) for c in spec[2]))
    return spec[1]
