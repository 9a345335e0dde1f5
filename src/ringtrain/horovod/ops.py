"""``horovod.torch``'s asynchronous collectives: ``*_async`` and ``*_async_`` variants.

Every call names its operation, checks what this rank can check alone (Horovod's
ValueErrors), describes the operation and submits it; the coordinator matches it across
ranks by name. A check that fails submits the operation refused (:func:`_checks`), so
the other members get this rank's error instead of waiting for it. The synchronous,
differentiable forms are in :mod:`ringtrain.horovod.autograd`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from ringtrain.collectives import has_internal_overlap
from ringtrain.horovod._coordinator import Meta, ProcessSet, Request
from ringtrain.horovod.basics import engine, global_process_set, is_homogeneous, local_size
from ringtrain.horovod.handles import (
    Adasum,
    Average,
    HorovodUsageError,
    Max,
    Min,
    Product,
    Sum,
    check_tensor,
    handle_average_backwards_compatibility,
    horovod_errors,
    meta_for,
    op_name,
    set_id,
    submit,
    submit_many,
    synchronize,
    unique_name,
)

__all__ = [
    "allgather_async", "allreduce_async", "allreduce_async_", "alltoall_async", "barrier",
    "broadcast_async", "broadcast_async_", "grouped_allgather_async", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter_async", "join", "prechecks",
    "reducescatter_async", "sparse_allreduce_async",
]


def _check_factors(prescale_factor: float, postscale_factor: float) -> tuple[float, float]:
    return float(prescale_factor), float(postscale_factor)


def _check_bool(kind: str, tensor: torch.Tensor, op: int, pre: float, post: float) -> None:
    # Horovod refuses bool tensors in reductions. Sum/Min/Max/Product of bools are the
    # logical any/all here, but an average or a scale factor truncates back to bool:
    # [True, True] averaged over 2 ranks came back [False, False], silently.
    if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool \
            and (op == Average or pre != 1.0 or post != 1.0):
        raise ValueError(f"{kind} of a bool tensor with op=hvd.{op_name(op).capitalize()}, "
                         f"prescale_factor={pre:g}, postscale_factor={post:g} truncates the result "
                         "back to bool; cast it first (tensor.int() or .float()), or use op=hvd.Max "
                         "(any rank True) or op=hvd.Min (every rank True)")


@contextlib.contextmanager
def _checks(kind: str, names: Sequence[str], sid: int, process_set: Any) -> Iterator[None]:
    """This rank's own checks of a call that submits ``names`` (reserved before them, in
    set ``sid``: see :func:`_reserve`), the ``process_set`` argument's first.

    A check that fails on one rank only raised there before anything was submitted: the
    other members waited for the operation for ever (Horovod's default has no stall
    limit), and the numbering of later unnamed operations shifted on this rank. Now the
    operations are submitted refused, so every member gets this rank's error (a
    NegotiationError naming the rank) and the names stay in step; this rank raises its
    own error, of Horovod's type."""
    try:
        set_id(process_set)
        yield
    except Exception as exc:
        _refuse(kind, names, sid, exc)
        raise


def _refuse(kind: str, names: Sequence[str], sid: int, exc: Exception) -> None:
    where = f"{kind} {names[0]!r} on rank {engine().rank}" if names else kind
    text = str(exc) if str(exc).startswith(where) else f"{where}: {type(exc).__name__}: {exc}"
    # Together (a group's other members are decided with them); not a member, or after
    # join(): there is no one to tell, this rank's error stands.
    with contextlib.suppress(Exception):
        engine().submit_many([Meta(n, kind, sid, refused=text) for n in names], [None] * len(names))


@contextlib.contextmanager
def prechecks(kind: str, name: str | None, process_set: Any,
              group: Sequence[Any] | None = None) -> Iterator[None]:
    """The checks a synchronous form (:mod:`ringtrain.horovod.autograd`) makes before it
    calls its ``*_async`` one (a non-tensor, ``op=`` with ``average=``, the compressor):
    one that fails takes the name the ``*_async`` call would have taken and submits it
    refused, as :func:`_checks` does; ``group``: a grouped call's tensors."""
    try:
        yield
    except Exception as exc:
        sid = _refusal_set(process_set)
        if sid is not None:
            base = unique_name(kind if group is None else f"grouped_{kind}", name, sid)
            _refuse(kind, [base] if group is None else _group_names(base, group), sid, exc)
        raise


def _refusal_set(process_set: Any) -> int | None:
    """The id of the process set a call is numbered and refused in: ``process_set``'s or,
    for one this rank cannot use, the set the other members most likely passed (None: no
    telling, so no refusal). A set removed on this rank only: its former id. A set (or a
    list of ranks) not registered here: the registered set with those ranks, as Horovod
    identifies a set by its ranks (``ProcessSet([])``: every rank)."""
    with contextlib.suppress(Exception):
        return set_id(process_set)
    with contextlib.suppress(Exception):
        eng = engine()
        if isinstance(process_set, ProcessSet) and process_set.ranks is not None:
            ranks, removed = process_set.ranks, process_set.removed_id
            if removed > 0 and removed not in eng.sets and eng.rank in ranks:
                return removed
        elif isinstance(process_set, (list, tuple)) and all(type(r) is int for r in process_set):
            ranks = sorted(set(process_set))
        else:
            return None
        ranks = ranks or list(range(eng.size))
        same = [i for i, (ps, _) in eng.sets.items() if i and ps.ranks == ranks]
        return same[0] if same else 0 if ranks == list(range(eng.size)) else None
    return None


def refuse(kind: str, tensor: torch.Tensor, name: str | None, process_set: ProcessSet, text: str,
           **fields: Any) -> None:
    """Submit the operation ``hvd.<kind>(tensor, name=name, ...)`` would, refused with
    ``text``: the other members get ``text`` as their error instead of waiting for this
    rank (which raises its own error after this)."""
    meta = meta_for(kind, tensor, name, process_set, **fields)
    engine().submit(replace(meta, refused=text), None)


def refuse_names(kind: str, names: Sequence[str | None], process_set: ProcessSet, text: str) -> None:
    """Submit the operations ``hvd.<kind>(..., name=n)`` would for each ``n`` of ``names``
    (None: the next unnamed one), refused with ``text``, whatever this rank holds for them
    (a non-tensor included): the other members get ``text`` instead of waiting."""
    sid = set_id(process_set)
    metas = [Meta(unique_name(kind, n, sid), kind, sid, refused=text) for n in names]
    with contextlib.suppress(Exception):  # as in _refuse: no one to tell after join()
        engine().submit_many(metas, [None] * len(metas))


def _check_usable(metas: Sequence[Meta], tensors: Sequence[torch.Tensor], in_place: bool) -> None:
    """Tensors a collective cannot take, refused at the call on every member (:func:`_checks`).

    A sparse (or other non-strided) tensor: Horovod refuses it with a ValueError (its
    collectives take dense tensors only). Here it failed inside the coordinator, after
    every member had agreed to run the operation, on the rank holding it only: the others
    waited in the backend for that rank's side, and the job was out of step from there on
    (every later operation stalled). In place, a tensor whose elements share memory
    (``expand()``): the result cannot be written into it, which failed the same way, as a
    recoverable HorovodInternalError (so ``hvd.elastic`` restarted over it). Horovod
    refuses every non-contiguous tensor in place; here only these are refused."""
    kind = metas[0].kind
    where = f"{kind} {metas[0].name!r} on rank {engine().rank}"
    sparse = next((t for t in tensors if t.layout != torch.strided), None)
    if sparse is not None:
        hint = ("pass tensor.to_dense(), or hvd.sparse_allreduce_async(tensor, name, op) for a sparse "
                "gradient" if kind == "allreduce" else "pass tensor.to_dense()")
        raise ValueError(f"{where}: a tensor with layout {sparse.layout} is not supported (collectives "
                       f"take dense tensors, as Horovod's); {hint}")
    bad = next((t for t in tensors if has_internal_overlap(t)), None) if in_place else None
    if bad is not None:
        raise ValueError(f"{where}: in place, elements of the "
                       f"tensor (shape {tuple(bad.shape)}, strides {bad.stride()}) share memory, as after "
                       "expand(), so the result cannot be written into it; pass tensor.clone() or use "
                       f"the out-of-place hvd.{kind}()")


def _set_for(process_set: Any) -> int:
    """``process_set``'s id, or the one a call on it is refused in (:func:`_refusal_set`);
    its error when there is none."""
    # Before hvd.init() the global set is unregistered too: Horovod's "not initialized"
    # error names the fix, the set's would point at hvd.add_process_set().
    engine()
    sid = _refusal_set(process_set)
    return set_id(process_set) if sid is None else sid


def _reserve(kind: str, name: str | None, process_set: ProcessSet) -> tuple[str, int]:
    """The call's full name and process set id, before any check (see :func:`_checks`)."""
    sid = _set_for(process_set)
    return unique_name(kind, name, sid), sid


def _numbered(base: str, tensors: Sequence[Any]) -> list[str]:
    return [f"{base}.{i}" for i in range(len(tensors))]


def _group_names(base: str, tensors: Sequence[Any]) -> list[str]:
    """The names a grouped call refuses: an empty one its first member's, which every
    other rank's group has (the coordinator then refuses the rest of the group)."""
    return _numbered(base, tensors) or [f"{base}.0"]


def _check_group(kind: str, tensors: Sequence[Any]) -> None:
    # Horovod's grouped calls fail on an empty list too (an IndexError on tensors[0]).
    if not tensors:
        raise ValueError(f"{kind} needs at least one tensor, got an empty list")
    for t in tensors:
        check_tensor(kind, t)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_adasum(tensor: torch.Tensor, process_set: ProcessSet) -> None:
    """Horovod's refusals of ``op=hvd.Adasum`` (horovod/torch/mpi_ops.py), with its
    NotImplementedError: on a process set other than the global one, and on a number of
    ranks (GPU tensors: of hosts) that is not a power of two. The tree here took any
    count, so a script got a combination Horovod never computes."""
    if not tensor.is_floating_point():
        raise ValueError(f"Adasum needs a floating-point tensor, got {tensor.dtype}")
    if set_id(process_set) != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet (as in Horovod); "
                                  "reduce over hvd.global_process_set, or use op=hvd.Average on the set")
    n, local = engine().size, local_size()
    if tensor.device.type != "cpu" and torch.cuda.is_available():
        if not is_homogeneous():
            raise NotImplementedError("Running GPU Adasum on heterogeneous cluster is not supported yet "
                                      "(as in Horovod): run the same number of ranks on every host")
        if not _power_of_two(n // local):
            raise NotImplementedError(f"Running GPU Adasum with non-power of 2 nodes ({n // local}) is not "
                                      "supported yet (as in Horovod); use 1, 2, 4, ... hosts")
    elif not _power_of_two(n):
        raise NotImplementedError(f"Running Adasum with non-power of 2 ranks ({n}) is not supported yet "
                                  "(as in Horovod); use 1, 2, 4, ... ranks or op=hvd.Average")


def _check_rows(kind: str, tensors: Sequence[torch.Tensor]) -> None:
    """Horovod's controller refuses a rank-zero (0-d) tensor for allgather and alltoall
    ("tried to ALLGATHER a rank-zero tensor"): they join or split along the first
    dimension, which a scalar lacks. It was taken as one row here, a result Horovod
    never gives."""
    if any(t.dim() == 0 for t in tensors):
        raise HorovodUsageError(f"{kind} of a rank-zero (0-d) tensor is not supported, as in Horovod: it "
                                "works along the first dimension, which a scalar has none of; pass "
                                "tensor.reshape(1)")


def _allreduce_meta(tensor: torch.Tensor, full: str, op: int, prescale_factor: float,
                    postscale_factor: float, process_set: ProcessSet) -> Meta:
    check_tensor("allreduce", tensor)
    pre, post = _check_factors(prescale_factor, postscale_factor)
    _check_bool("allreduce", tensor, op, pre, post)
    if op == Adasum:
        _check_adasum(tensor, process_set)
    if op in (Min, Max, Product) and tensor.is_complex():
        # Complex numbers have no order, and the backends (Gloo, NCCL) have no complex
        # product: it failed in the coordinator on every rank, after the negotiation, as a
        # recoverable HorovodInternalError (what hvd.elastic takes for a lost rank).
        raise ValueError(f"allreduce of a {tensor.dtype} tensor with op=hvd.{op_name(op).capitalize()} "
                         "is not supported (complex numbers have no order, and the backends no "
                         "complex product); reduce torch.view_as_real(tensor) or use op=hvd.Sum")
    return meta_for("allreduce", tensor, None, process_set, named=full, op=op_name(op), prescale=pre,
                    postscale=post)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Reduce ``tensor`` in place across the process set; returns a handle."""
    full, sid = _reserve("allreduce", name, process_set)
    with _checks("allreduce", [full], sid, process_set):
        op = handle_average_backwards_compatibility(op, average)
        meta = _allreduce_meta(tensor, full, op, prescale_factor, postscale_factor, process_set)
        _check_usable([meta], [tensor], in_place=True)
    return submit(meta, Request(meta, tensor, output=tensor))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Reduce a copy of ``tensor`` across the process set; returns a handle."""
    full, sid = _reserve("allreduce", name, process_set)
    with _checks("allreduce", [full], sid, process_set):
        op = handle_average_backwards_compatibility(op, average)
        meta = _allreduce_meta(tensor, full, op, prescale_factor, postscale_factor, process_set)
        _check_usable([meta], [tensor], in_place=False)
    return submit(meta, Request(meta, tensor))


def _grouped_metas(tensors: list[torch.Tensor], base: str, op: int, prescale_factor: float,
                   postscale_factor: float, process_set: ProcessSet, in_place: bool) -> list[Meta]:
    _check_group("grouped_allreduce", tensors)
    devices = {t.device.type for t in tensors}
    if len(devices) > 1:
        raise HorovodUsageError("grouped_allreduce tensors must all be on the CPU or all on GPUs, "
                                f"got {sorted(devices)}")
    metas = [_allreduce_meta(t, n, op, prescale_factor, postscale_factor, process_set)
             for t, n in zip(tensors, _numbered(base, tensors), strict=True)]
    _check_usable(metas, tensors, in_place)
    return metas


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    tensors = list(tensors)
    base, sid = _reserve("grouped_allreduce", name, process_set)
    with _checks("allreduce", _group_names(base, tensors), sid, process_set):
        op = handle_average_backwards_compatibility(op, average)
        metas = _grouped_metas(tensors, base, op, prescale_factor, postscale_factor, process_set, False)
    return submit_many(metas, [Request(m, t) for m, t in zip(metas, tensors, strict=True)])


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    tensors = list(tensors)
    base, sid = _reserve("grouped_allreduce", name, process_set)
    with _checks("allreduce", _group_names(base, tensors), sid, process_set):
        op = handle_average_backwards_compatibility(op, average)
        metas = _grouped_metas(tensors, base, op, prescale_factor, postscale_factor, process_set, True)
    return submit_many(metas, [Request(m, t, output=t) for m, t in zip(metas, tensors, strict=True)])


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: ProcessSet = global_process_set) -> Any:
    """Allreduce of a sparse tensor as Horovod does it: gather every rank's indices and
    values; the callable it returns (pass it to ``synchronize`` or call it) gives the
    summed (or averaged) sparse tensor."""
    with _checks("allgather", [f"allgather.{name}.indices", f"allgather.{name}.values"], _set_for(process_set),
                 process_set):
        t = tensor.coalesce() if not tensor.is_coalesced() else tensor
        rows = t.indices().t().contiguous()
    indices = allgather_async(rows, name=f"{name}.indices", process_set=process_set)
    values = allgather_async(t.values(), name=f"{name}.values", process_set=process_set)
    n = process_set.size()

    def result() -> torch.Tensor:
        v = synchronize(values)
        i = synchronize(indices)
        if op == Average:
            v = v / n
        return torch.sparse_coo_tensor(i.t(), v, t.size())

    return result


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Concatenate every member's tensor along dim 0 (first dimensions may differ)."""
    full, sid = _reserve("allgather", name, process_set)
    with _checks("allgather", [full], sid, process_set):
        meta = meta_for("allgather", tensor, None, process_set, named=full)
        _check_rows("allgather", [tensor])
        _check_usable([meta], [tensor], in_place=False)
    return submit(meta, Request(meta, tensor))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    tensors = list(tensors)  # a generator is read once
    base, sid = _reserve("grouped_allgather", name, process_set)
    with _checks("allgather", _group_names(base, tensors), sid, process_set):
        _check_group("grouped_allgather", tensors)
        metas = [meta_for("allgather", t, None, process_set, named=n)
                 for t, n in zip(tensors, _numbered(base, tensors), strict=True)]
        _check_rows("grouped_allgather", tensors)
        _check_usable(metas, tensors, in_place=False)
    return submit_many(metas, [Request(m, t) for m, t in zip(metas, tensors, strict=True)])


def _root_meta(tensor: torch.Tensor, root_rank: int, full: str, process_set: ProcessSet) -> Meta:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise ValueError(f"root_rank must be an int, got {root_rank!r}")
    return meta_for("broadcast", tensor, None, process_set, named=full, root=root_rank)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    full, sid = _reserve("broadcast", name, process_set)
    with _checks("broadcast", [full], sid, process_set):
        meta = _root_meta(tensor, root_rank, full, process_set)
        _check_usable([meta], [tensor], in_place=False)
    return submit(meta, Request(meta, tensor))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    full, sid = _reserve("broadcast", name, process_set)
    with _checks("broadcast", [full], sid, process_set):
        meta = _root_meta(tensor, root_rank, full, process_set)
        _check_usable([meta], [tensor], in_place=True)
    return submit(meta, Request(meta, tensor, output=tensor))


def _send_splits(tensor: torch.Tensor, splits: Any, n: int) -> tuple[list[int], torch.Tensor | None]:
    """Rows sent to each of the ``n`` members, and the splits tensor to shape the received
    counts like (None: a list, or no splits)."""
    check_tensor("alltoall", tensor)
    _check_rows("alltoall", [tensor])
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"alltoall without splits needs the first dimension ({rows}) to be a "
                             f"multiple of the process set size ({n}); pass splits=")
        return [rows // n] * n, None
    like: torch.Tensor | None = None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall splits must be a tensor of int32, got {splits.dtype}")
        like = splits
        send = [int(s) for s in splits.cpu().tolist()]
    else:
        send = [int(s) for s in splits]
    if len(send) != n or any(s < 0 for s in send):
        raise ValueError(f"alltoall splits {send} must be {n} non-negative counts")
    if sum(send) > rows:
        raise ValueError(f"alltoall splits {send} sum to {sum(send)}, more than the first "
                         f"dimension {rows} of the tensor")
    return send, like


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Send ``splits[i]`` rows to member i; the handle gives ``(output, received_splits)``."""
    full, sid = _reserve("alltoall", name, process_set)
    with _checks("alltoall", [full], sid, process_set):
        send, like = _send_splits(tensor, splits, process_set.size())
        meta = meta_for("alltoall", tensor, None, process_set, named=full, splits=tuple(send))
        _check_usable([meta], [tensor], in_place=False)
    rows = tensor.shape[0]
    data = tensor if sum(send) == rows else tensor[: sum(send)]

    def post(result: tuple[torch.Tensor, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        output, recv = result
        received = torch.tensor(recv, dtype=torch.int32)
        if like is not None:
            received = received.to(device=like.device, dtype=like.dtype)
        return output, received

    return submit(meta, Request(meta, data), post)


def _reducescatter_meta(tensor: torch.Tensor, full: str, op: int, process_set: ProcessSet,
                        prescale_factor: float, postscale_factor: float) -> Meta:
    check_tensor("reducescatter", tensor)
    if op not in (Average, Sum):
        raise HorovodUsageError(f"reducescatter supports op=hvd.Average or hvd.Sum, not hvd.{op_name(op).capitalize()}")
    if tensor.dim() == 0:
        raise HorovodUsageError("reducescatter splits the first dimension; a scalar has none")
    pre, post = _check_factors(prescale_factor, postscale_factor)
    _check_bool("reducescatter", tensor, op, pre, post)
    return meta_for("reducescatter", tensor, None, process_set, named=full, op=op_name(op), prescale=pre,
                    postscale=post)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    full, sid = _reserve("reducescatter", name, process_set)
    with _checks("reducescatter", [full], sid, process_set):
        meta = _reducescatter_meta(tensor, full, op, process_set, prescale_factor, postscale_factor)
        _check_usable([meta], [tensor], in_place=False)
    return submit(meta, Request(meta, tensor))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: int = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    tensors = list(tensors)  # read twice below: a generator would be empty the second time
    base, sid = _reserve("grouped_reducescatter", name, process_set)
    with _checks("reducescatter", _group_names(base, tensors), sid, process_set):
        _check_group("grouped_reducescatter", tensors)
        metas = [_reducescatter_meta(t, n, op, process_set, prescale_factor, postscale_factor)
                 for t, n in zip(tensors, _numbered(base, tensors), strict=True)]
        _check_usable(metas, tensors, in_place=False)
    return submit_many(metas, [Request(m, t) for m, t in zip(metas, tensors, strict=True)])


def join(device: int = -1) -> int:
    """This rank has no more data: it contributes zeros to the others' allreduces until
    every rank has joined. Returns the rank that joined last (the same on every rank).
    A rank that never joins is named in a warning every stall-check interval, as Horovod
    does, and with a stall limit set (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``,
    ``RINGTRAIN_STALL_TIMEOUT``) a ``HorovodInternalError`` after it, as every other
    operation's failure here (:mod:`ringtrain.horovod.stall`)."""
    with horovod_errors():
        return int(engine().join().wait())


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every member of the process set reaches its barrier."""
    sid = _set_for(process_set)
    full = unique_name("barrier", None, sid)
    with _checks("barrier", [full], sid, process_set):  # the process set's own check
        meta = Meta(full, "barrier", sid)
    synchronize(submit(meta, None))

