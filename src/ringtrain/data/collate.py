"""Collate samples into a batch, writing straight into memory the caller provides.

``default_collate(samples, alloc)`` gives what ``torch.utils.data.default_collate``
gives (tensors, ndarrays and numbers become tensors stacked along a new first
dimension, of the dtype ``torch.stack`` promotes them to; a tuple sample becomes a
list of fields, a namedtuple stays one, a mapping or list keeps its type as torch
keeps it; strings and bytes become a list, a tuple in a sequence sample), but every
numeric field is written by one ``stack(..., out=...)`` into a buffer that
``alloc(nbytes)`` returns. Where torch raises ``TypeError`` (``None``, other objects,
ndarrays of strings or objects), so does this, with torch's words (:func:`unbatchable`). In
a loader worker ``alloc`` hands out pieces of a reused shared-memory slot, so the
batch is built in place: no intermediate tensors, no pickling of array data.

A batch travels as a *spec*: a tree of builtin tuples whose array leaves are
``(offset, nbytes, dtype name, shape, kind)`` records into a byte buffer.
:func:`pack` turns any batch (also one from a user's ``collate_fn``) into a spec,
copying only leaves that are not in the buffer yet; :func:`unpack` rebuilds the batch
as views of a buffer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from functools import reduce
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from ringtrain.errors import DataError

__all__ = [
    "Alloc",
    "Arena",
    "SlotFull",
    "StreamCollator",
    "STREAM_MIN_BYTES",
    "default_collate",
    "sample_nbytes",
    "fresh_alloc",
    "pack",
    "unpack",
    "spec_nbytes",
    "join_halves",
    "RawNumbers",
    "unbatchable",
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
    shapes = sorted({tuple(getattr(s, "shape", ())) for s in samples})[:4]
    return DataError(
        f"cannot stack {what} of different shapes {shapes} into one batch ({err}); "
        "pad or resize them in the dataset, or pass a collate_fn"
    )


class RawNumbers(list):  # type: ignore[type-arg]
    """Numbers of one field as the samples gave them (a half of a batch: typed once the
    two halves are joined, see :func:`join_halves`)."""


def default_collate(samples: Sequence[Any], alloc: Alloc = fresh_alloc,
                    raw_numbers: bool = False) -> Any:
    """Collate a list of samples into a batch whose arrays are written via ``alloc``;
    ``raw_numbers``: number fields stay :class:`RawNumbers`."""
    elem = samples[0]
    n = len(samples)
    if isinstance(elem, torch.Tensor):
        dtype = _stack_dtype(samples, elem.dtype)
        nbytes = n * elem.numel() * dtype.itemsize
        out = _torch_out(alloc(nbytes), dtype, (n, *elem.shape))
        try:
            torch.stack(samples, out=out)  # type: ignore[arg-type]
        except RuntimeError as err:
            if any(s.shape != elem.shape for s in samples):
                raise _shape_error("tensors", samples, err) from None
            raise
        return out
    if isinstance(elem, np.ndarray) and elem.dtype in _NP_TO_TORCH:
        try:
            arr = alloc(n * elem.nbytes).view(elem.dtype).reshape((n, *elem.shape))
            whole = elem.ndim > 0 and len({s.shape for s in samples}) == 1
            try:
                _stack_arrays(samples, arr, whole, "no")
            except TypeError:
                # Not all of the first sample's dtype (casting "no" refused them): the
                # batch has the dtype torch.stack promotes them to, as under DataLoader.
                np_dtype = _np_stack_dtype({s.dtype for s in samples})
                if np_dtype != elem.dtype:
                    arr = alloc(n * elem.size * np_dtype.itemsize).view(np_dtype).reshape(arr.shape)
                _stack_arrays(samples, arr, whole, "same_kind")
        except (ValueError, AttributeError) as err:
            raise _shape_error("arrays", samples, err) from None
        return torch.from_numpy(arr)
    if isinstance(elem, (bool, np.bool_, int, np.integer, float, np.floating, np.complexfloating)):
        if raw_numbers:
            return RawNumbers(samples)
        if isinstance(elem, (bool, np.bool_)):
            return _numbers(samples, np.dtype(np.bool_), alloc)
        if isinstance(elem, (int, np.integer)):
            return _numbers(samples, np.dtype(np.int64) if isinstance(elem, int) else elem.dtype,
                            alloc)
        return _numbers(samples, np.dtype(np.float64) if isinstance(elem, float) else elem.dtype,
                        alloc)
    if isinstance(elem, (str, bytes)):
        # torch's collate returns them as it was given them: a field of a sequence
        # sample (a tuple from zip) stays a tuple, a batch or a mapping's field a list.
        return samples if type(samples) is tuple else list(samples)
    if isinstance(elem, Mapping):
        try:
            return mapping_like(elem, {key: default_collate([s[key] for s in samples], alloc,
                                                            raw_numbers) for key in elem})
        except KeyError as err:
            raise DataError(f"samples in a batch have different keys (missing {err}); "
                            "give every sample the same keys") from None
    if isinstance(elem, Sequence):
        try:
            transposed = list(zip(*samples, strict=True))
        except ValueError:
            raise DataError(f"samples in a batch have different lengths (first has {len(elem)}); "
                            "return the same number of fields from every __getitem__") from None
        return sequence_like(elem, [default_collate(f, alloc, raw_numbers) for f in transposed])
    raise unbatchable(elem)


#: torch's message (``torch.utils.data._utils.collate.default_collate_err_msg_format``),
#: so a script or test matching it matches ours too.
_UNBATCHABLE = ("default_collate: batch must contain tensors, numpy arrays, numbers, dicts or "
                "lists; found {}")


def unbatchable(elem: Any) -> TypeError:
    """The ``TypeError`` torch's ``default_collate`` raises for ``elem`` (``None``,
    ``complex``, another object, an ndarray of strings or objects): the same type and
    words as under DataLoader, where a script that checks for it expects them, plus the
    fix."""
    found = elem.dtype if isinstance(elem, np.ndarray) else type(elem)
    return TypeError(_UNBATCHABLE.format(found) + "; return tensors, arrays or numbers from "
                     "the dataset, or pass a collate_fn that batches this field")


def _stack_arrays(samples: Sequence[Any], out: np.ndarray, whole: bool, casting: str) -> None:
    if whole:
        # concatenate along axis 0 lays rows out exactly as stack would, at a quarter
        # of its per-call cost (measured: 27 vs 109 us for 256 rows).
        np.concatenate(samples, out=out.reshape(-1, *out.shape[2:]),  # type: ignore[call-overload]
                       casting=casting)
    else:
        np.stack(samples, out=out, casting=casting)  # type: ignore[call-overload]


def _stack_dtype(samples: Sequence[Any], first: torch.dtype) -> torch.dtype:
    """The dtype ``torch.stack`` gives ``samples`` (tensors): their promoted dtype, as
    DataLoader's ``default_collate`` in the main process; float32 and float64 samples
    make a float64 batch, not one of the first sample's float32 (a ``stack(out=)`` into
    that casts silently)."""
    dtypes = set(map(_DTYPE, samples))
    if len(dtypes) == 1:
        return first
    try:
        return reduce(torch.promote_types, dtypes)
    except TypeError:
        return first  # not all tensors: torch.stack says what is wrong
    except RuntimeError as err:  # torch promotes no uint16/32/64 with another dtype
        raise DataError(f"cannot stack samples of dtypes {sorted(map(str, dtypes))} into one "
                        f"batch ({err}); give every sample one dtype in the dataset, or pass "
                        "a collate_fn") from None


def _np_stack_dtype(dtypes: set[Any]) -> np.dtype:
    """The numpy dtype of the batch of arrays of ``dtypes``: torch's promotion (DataLoader
    converts each array to a tensor, then stacks), which differs from numpy's (int32 with
    float32 is float32 in torch, float64 in numpy)."""
    try:
        torch_dtypes = {_NP_TO_TORCH[d] for d in dtypes}
    except KeyError:
        raise DataError(f"cannot stack arrays of dtypes {sorted(map(str, dtypes))} into one "
                        "batch: torch has no dtype for some of them; give every sample one "
                        "dtype in the dataset, or pass a collate_fn") from None
    return _TORCH_TO_NP[_stack_dtype([torch.empty(0, dtype=d) for d in torch_dtypes],
                                     next(iter(torch_dtypes)))]


_DTYPE = attrgetter("dtype")


def mapping_like(elem: Mapping, items: dict) -> Mapping:
    """The batch's mapping of ``items`` with the type of its first sample ``elem``, as
    torch's collate builds it: a copy of ``elem`` updated with them where it is mutable
    (an ``OrderedDict`` stays one, a ``defaultdict`` keeps its factory), else
    ``type(elem)(items)``, else a plain dict."""
    if type(elem) is dict:
        return items
    try:
        if isinstance(elem, MutableMapping):
            clone = copy.copy(elem)
            clone.update(items)
            return clone
        return type(elem)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def sequence_like(elem: Sequence, fields: list) -> Any:
    """The batch's sequence of ``fields`` for a first sample ``elem``, as torch's collate
    builds it: a list for a tuple (a namedtuple stays one), a copy of ``elem`` with the
    fields set for another mutable sequence (a list subclass stays one), else
    ``type(elem)(fields)``, else a list."""
    if type(elem) is list or type(elem) is tuple:
        return fields
    if isinstance(elem, tuple):
        return type(elem)(*fields) if hasattr(elem, "_fields") else fields
    try:
        if isinstance(elem, MutableSequence):
            clone = copy.copy(elem)
            for i, f in enumerate(fields):
                clone[i] = f
            return clone
        return type(elem)(fields)  # type: ignore[call-arg]
    except TypeError:
        return fields


def _numbers(samples: Sequence[Any], dtype: np.dtype, alloc: Alloc) -> torch.Tensor:
    """One number per sample as a tensor of ``dtype`` (from the first sample's type).

    numpy reads every value first: where they do not all have that type (``[0, 0.5]``,
    an int first), torch's own collate decides the dtype, as under DataLoader
    (float32 there), instead of every value being cut to the first one's type.
    """
    values = np.array(samples)
    if values.dtype != dtype:
        from torch.utils.data import default_collate as torch_collate

        mixed = torch_collate(list(samples))
        out = _torch_out(alloc(mixed.numel() * mixed.element_size()), mixed.dtype, mixed.shape)
        return out.copy_(mixed)
    arr = alloc(values.nbytes).view(dtype)
    arr[:] = values
    return torch.from_numpy(arr)


# ---- streaming collate ----------------------------------------------------------------
#: Samples at least this large are copied into the batch one by one, as they are loaded.
STREAM_MIN_BYTES = 16 << 10


def sample_nbytes(sample: Any) -> int:
    """Bytes of the arrays and tensors in one sample."""
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    if isinstance(sample, np.ndarray):
        return sample.nbytes
    if isinstance(sample, Mapping):
        return sum(sample_nbytes(v) for v in sample.values())
    if isinstance(sample, (tuple, list)):
        return sum(sample_nbytes(v) for v in sample)
    return 0


class StreamCollator:
    """Default collate, one sample at a time, into outputs allocated from the first.

    Why: collating a list of large samples reads them all back from memory after the
    last one was made, and keeping 256 samples alive defeats the allocator's reuse of
    freed blocks. Copying each sample into its row while it is still in cache, then
    dropping it, measured 62 vs 107 us per 3x64x64 float32 sample (fetch + collate).
    Small samples keep the list-then-stack path, where per-sample Python calls would
    cost more than the cache misses.
    """

    def __init__(self, first: Any, n: int, alloc: Alloc, raw_numbers: bool = False) -> None:
        self.n = n
        self._raw_numbers = raw_numbers
        self._put, self._get = self._build(first, n, alloc, "sample", False)

    def put(self, i: int, sample: Any) -> None:
        self._put(i, sample)

    def result(self) -> Any:
        return self._get()

    def _build(self, elem: Any, n: int, alloc: Alloc, where: str, in_seq: bool
               ) -> tuple[Any, Any]:
        """``(put, get)`` of one field; ``in_seq``: a field of a sequence sample."""
        if isinstance(elem, torch.Tensor):
            shape = elem.shape
            tout = [_torch_out(alloc(n * elem.numel() * elem.element_size()), elem.dtype,
                               (n, *shape))]

            def put_tensor(i: int, v: torch.Tensor) -> None:
                if v.shape != shape:
                    raise _stream_shape_error(where, shape, v)
                out = tout[0]
                if v.dtype is not out.dtype:
                    out = tout[0] = _widened(where, out, i, v, alloc)
                out[i] = v
            return put_tensor, lambda: tout[0]
        if isinstance(elem, np.ndarray) and elem.dtype in _NP_TO_TORCH:
            ashape = elem.shape
            aout = [alloc(n * elem.nbytes).view(elem.dtype).reshape((n, *ashape))]

            def put_array(i: int, v: np.ndarray) -> None:
                if getattr(v, "shape", None) != ashape:
                    raise _stream_shape_error(where, ashape, v)
                arr = aout[0]
                if v.dtype != arr.dtype:
                    arr = aout[0] = _widened(where, torch.from_numpy(arr), i, v, alloc).numpy()
                arr[i] = v
            return put_array, lambda: torch.from_numpy(aout[0])
        number = _number_dtype(elem)
        if number is not None:  # kept as they come, typed once all are in (see _numbers)
            nums: list[Any] = [None] * n
            if self._raw_numbers:
                return nums.__setitem__, lambda: RawNumbers(nums)
            return nums.__setitem__, lambda: _numbers(nums, number, alloc)
        if isinstance(elem, Mapping):
            keys = list(elem)
            subs = {k: self._build(elem[k], n, alloc, f"{where}[{k!r}]", False) for k in keys}
            proto = _hollow(elem)

            def put_map(i: int, v: Mapping) -> None:
                try:
                    for k, (put, _) in subs.items():
                        put(i, v[k])
                except KeyError as err:
                    raise DataError(f"samples in a batch have different keys (missing {err});"
                                    " give every sample the same keys") from None
            return put_map, lambda: mapping_like(proto, {k: get() for k, (_, get) in subs.items()})
        if isinstance(elem, Sequence) and not isinstance(elem, (str, bytes)):
            parts = [self._build(e, n, alloc, f"{where}[{j}]", True) for j, e in enumerate(elem)]
            size = len(parts)
            seq_proto = _hollow(elem)

            def put_seq(i: int, v: Any) -> None:
                if len(v) != size:
                    raise DataError(f"samples in a batch have different lengths (first has "
                                    f"{size}); return the same fields from every __getitem__")
                for (put, _), x in zip(parts, v, strict=False):
                    put(i, x)
            return put_seq, lambda: sequence_like(seq_proto, [get() for _, get in parts])
        if not isinstance(elem, (str, bytes)):
            raise unbatchable(elem)
        items: list[Any] = [None] * n
        if in_seq:  # as default_collate: a tuple
            return items.__setitem__, lambda: tuple(items)
        return items.__setitem__, lambda: items


def _hollow(elem: Any) -> Any:
    """``elem``'s container without its values (what :func:`mapping_like` and
    :func:`sequence_like` need of a first sample), so a streamed batch does not keep its
    first sample alive."""
    if type(elem) in (dict, list, tuple):
        return type(elem)()
    try:
        if isinstance(elem, tuple):  # a namedtuple: only its type is used
            cls: Any = type(elem)
            return cls(*([None] * len(elem)))
        if isinstance(elem, MutableMapping):
            shell = copy.copy(elem)
            shell.update(dict.fromkeys(elem))
            return shell
        if isinstance(elem, MutableSequence):
            seq = copy.copy(elem)
            for i in range(len(seq)):
                seq[i] = None
            return seq
    except TypeError:
        pass
    return elem


def _widened(where: str, out: torch.Tensor, filled: int, sample: Any, alloc: Alloc
             ) -> torch.Tensor:
    """The streamed batch ``out`` (rows before ``filled`` written) in the dtype that
    stacking it with ``sample`` gives (``torch.stack``'s promotion, as the list path and
    DataLoader's main process): a new buffer with those rows cast, when it differs."""
    if isinstance(sample, np.ndarray):
        want = _NP_TO_TORCH.get(sample.dtype)
        if want is None:
            raise DataError(f"cannot stack {where} of dtype {sample.dtype} into a batch: torch "
                            "has no such dtype; give every sample one dtype in the dataset, "
                            "or pass a collate_fn")
    else:
        want = sample.dtype
    dtype = _stack_dtype([out[:0], torch.empty(0, dtype=want)], out.dtype)
    if dtype is out.dtype:
        return out
    wider = _torch_out(alloc(out.numel() * dtype.itemsize), dtype, out.shape)
    wider[:filled] = out[:filled]
    return wider


def _number_dtype(elem: Any) -> np.dtype | None:
    if isinstance(elem, (bool, np.bool_)):
        return np.dtype(np.bool_)
    if isinstance(elem, int):
        return np.dtype(np.int64)
    if isinstance(elem, float):
        return np.dtype(np.float64)
    if isinstance(elem, (np.integer, np.floating, np.complexfloating)) and elem.dtype in _NP_TO_TORCH:
        return elem.dtype
    return None


def _stream_shape_error(where: str, want: Any, got: Any) -> DataError:
    shape = tuple(got.shape) if hasattr(got, "shape") else type(got).__name__
    return DataError(f"cannot stack {where} of shape {shape} with shape {tuple(want)} into "
                     "one batch; pad or resize them in the dataset, or pass a collate_fn")


# A list is described element by element only when it holds arrays or containers; a
# list of strings or other objects (a field of strings, a collate_fn's output) travels whole.
_CONTAINERS = (torch.Tensor, np.ndarray, tuple, list, Mapping, MutableSequence)


# ---- spec: how a batch travels -------------------------------------------------------
# Leaves: ("a", offset, nbytes, dtype name, shape, is_torch); ("o", obj); ("r", numbers).
# Nodes:  ("t", children), ("l", children), ("d", keys, children), ("n", cls, children),
#         ("m", hollow mapping, keys, children), ("s", hollow sequence, children): a
#         mutable mapping or sequence of another type than dict and list (an OrderedDict
#         from OrderedDict samples), rebuilt by mapping_like / sequence_like.
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
    if type(batch) is RawNumbers:
        return ("r", list(batch))
    if type(batch) is dict:
        return ("d", tuple(batch), tuple(pack(v, arena) for v in batch.values()))
    if isinstance(batch, tuple):
        if hasattr(batch, "_fields"):
            return ("n", type(batch), tuple(pack(v, arena) for v in batch))
        if type(batch) is tuple and batch and all(isinstance(v, (str, bytes)) for v in batch):
            return ("o", batch)  # strings of a sequence field (see default_collate)
        return ("t", tuple(pack(v, arena) for v in batch))
    if type(batch) is list:
        if batch and isinstance(batch[0], _CONTAINERS):
            return ("l", tuple(pack(v, arena) for v in batch))
        return ("o", batch)
    hollow = _rebuildable(batch)
    if hollow is not None and isinstance(batch, Mapping):
        return ("m", hollow, tuple(batch), tuple(pack(v, arena) for v in batch.values()))
    if hollow is not None:
        return ("s", hollow, tuple(pack(v, arena) for v in batch))
    return ("o", batch)


def _rebuildable(batch: Any) -> Any:
    """For a mutable mapping or sequence that :func:`mapping_like` / :func:`sequence_like`
    rebuild with its own type from its hollow copy: that copy; else None (the batch then
    travels whole, pickled)."""
    if isinstance(batch, (MutableMapping, MutableSequence)):
        hollow = _hollow(batch)
        if hollow is not batch:
            return hollow
    return None


def spec_nbytes(batch: Any) -> int:
    """Bytes (with alignment) :func:`pack` needs for ``batch`` in an empty arena."""
    if isinstance(batch, torch.Tensor):
        return -(-batch.numel() * batch.element_size() // ALIGN) * ALIGN
    if isinstance(batch, np.ndarray) and batch.dtype in _NP_TO_TORCH:
        return -(-batch.nbytes // ALIGN) * ALIGN
    if type(batch) is RawNumbers:
        return 0
    if type(batch) is dict:
        return sum(spec_nbytes(v) for v in batch.values())
    if isinstance(batch, tuple) or (type(batch) is list and batch
                                    and isinstance(batch[0], _CONTAINERS)):
        return sum(spec_nbytes(v) for v in batch)
    if type(batch) is not list and _rebuildable(batch) is not None:
        values = batch.values() if isinstance(batch, Mapping) else batch
        return sum(spec_nbytes(v) for v in values)
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
        return {k: unpack(c, buf, copy) for k, c in zip(spec[1], spec[2], strict=False)}
    if kind == "n":
        return spec[1](*(unpack(c, buf, copy) for c in spec[2]))
    if kind == "m":
        return mapping_like(spec[1], {k: unpack(c, buf, copy)
                                      for k, c in zip(spec[2], spec[3], strict=False)})
    if kind == "s":
        return sequence_like(spec[1], [unpack(c, buf, copy) for c in spec[2]])
    if kind == "r":
        return default_collate(spec[1])
    return spec[1]


# ---- halves of one batch ---------------------------------------------------------------
def join_halves(first: tuple, first_buf: np.ndarray, second: tuple, second_buf: np.ndarray
                ) -> tuple[tuple, np.ndarray]:
    """One batch from the specs of its two halves, each collated by
    :func:`default_collate` (``raw_numbers=True``) over its own buffer: ``(spec,
    buffer)``, every array the first half's rows then the second's (one copy), numbers
    typed as for the whole batch. Raises :class:`DataError` where the halves' samples
    could not have been stacked into one batch either."""
    arena = _GrowingArena(np.empty(max(1, first_buf.nbytes + second_buf.nbytes), dtype=np.uint8))
    spec = _join(first, first_buf, second, second_buf, arena, "sample")
    return spec, arena.buf[:arena.used]


def _join(a: tuple, abuf: np.ndarray, b: tuple, bbuf: np.ndarray, arena: Arena,
          where: str) -> tuple:
    kind = a[0]
    if kind == "a" and b[0] == "a":
        _, aoff, an, dtype, ashape, is_torch = a
        _, boff, bn, bdtype, bshape, b_torch = b
        if tuple(ashape[1:]) != tuple(bshape[1:]) or (dtype != bdtype and not (is_torch and b_torch)):
            raise DataError(f"cannot stack {where} of shape {tuple(bshape[1:])} ({bdtype}) "
                            f"with shape {tuple(ashape[1:])} ({dtype}) into one batch; pad or "
                            "resize them in the dataset, or pass a collate_fn")
        shape = (ashape[0] + bshape[0], *ashape[1:])
        if dtype != bdtype:
            # The halves' dtypes differ: the batch has the dtype torch.stack promotes
            # all its samples to, as collating it whole gives (float32 and float64 rows
            # make a float64 batch); the arena grows where the rows widen.
            arows, brows = unpack(a, abuf), unpack(b, bbuf)
            want = _stack_dtype([arows, brows], arows.dtype)
            nbytes = (arows.numel() + brows.numel()) * want.itemsize
            out = arena.alloc(nbytes)
            joined = _torch_out(out, want, shape)
            joined[:ashape[0]] = arows
            joined[ashape[0]:] = brows
            return ("a", out.ctypes.data - arena.base, nbytes,
                    str(want).removeprefix("torch."), shape, True)
        out = arena.alloc(an + bn)
        out[an:] = bbuf[boff:boff + bn]
        out[:an] = abuf[aoff:aoff + an]
        return ("a", out.ctypes.data - arena.base, an + bn, dtype, shape, is_torch)
    if kind == "r" and b[0] == "r":
        # Numbers typed by the whole batch's rule: [0, 1] and [0.5, 2] are float32 as
        # [0, 1, 0.5, 2] is (see _numbers), not the halves' int64 and float64.
        return pack(default_collate(a[1] + b[1], arena.alloc), arena)
    if kind == "o" and b[0] == "o" and type(a[1]) in (list, tuple) and type(a[1]) is type(b[1]):
        return ("o", a[1] + b[1])  # strings and bytes, as the samples gave them
    if kind in ("d", "m") and b[0] == kind and a[-2] != b[-2] and set(a[-2]) <= set(b[-2]):
        # The whole batch has its first sample's keys (torch's default_collate ignores
        # the others' extra keys). The second half, collated by its own first sample's
        # keys, has every one of them, in its order: take those, in the first half's.
        field = dict(zip(b[-2], b[-1], strict=True))
        b = (*b[:-2], a[-2], tuple(field[k] for k in a[-2]))
    if kind in ("m", "s"):  # compared by their hollow copies' types (and keys)
        same = kind == b[0] and type(a[1]) is type(b[1]) and a[2:-1] == b[2:-1]
    else:
        same = kind in ("t", "l", "d", "n") and kind == b[0] and a[1:-1] == b[1:-1]
    if not same or len(a[-1]) != len(b[-1]):
        raise DataError(f"samples in a batch differ in structure at {where}; give every "
                        "sample the same fields")
    children = tuple(_join(x, abuf, y, bbuf, arena, f"{where}[{j}]")
                     for j, (x, y) in enumerate(zip(a[-1], b[-1], strict=True)))
    return (*a[:-1], children)  # "t", "l" (fields), "d"/"m" (keys), "n", "s": field by field


class _GrowingArena(Arena):
    """An arena that grows (the buffer is copied) instead of raising :class:`SlotFull`:
    for :func:`join_halves`, whose output is larger than its inputs where one half's
    rows are widened. Only offsets into it are kept, never views across an ``alloc``."""

    __slots__ = ()

    def alloc(self, nbytes: int) -> np.ndarray:
        stop = self.used + nbytes
        if stop > self.buf.nbytes:
            bigger = np.empty(max(stop, 2 * self.buf.nbytes), dtype=np.uint8)
            bigger[:self.used] = self.buf[:self.used]
            self.buf, self.base, self.end = bigger, bigger.ctypes.data, bigger.ctypes.data + bigger.nbytes
        return super().alloc(nbytes)
