"""Horovod-style collectives on ``torch.distributed``.

Every function takes an optional ``name``: a label that appears in errors and in the
timeline, so a failure says which tensor was being exchanged. Reductions take a
:class:`ReduceOp` (``Average``, ``Sum``, ``Min``, ``Max``) and an ``algorithm``: a
strategy of :mod:`ringtrain.sync` by name (``"native"``: the backend's own allreduce,
with the stall timeout; ``"ring"``, ``"ps"``) or an allreduce object. Before anything is
issued the ranks compare what they submit (:mod:`ringtrain.agreement`).
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ringtrain import agreement, inflight, runtime
from ringtrain.errors import CollectiveError, ConfigError, NotInitializedError, first_line

__all__ = [
    "AllreduceAlgorithm",
    "has_internal_overlap",
    "Average",
    "Handle",
    "Max",
    "Min",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "reducescatter",
    "finish_average",
    "set_algorithm_resolver",
    "staged",
    "synchronize",
    "torch_op",
]


class ReduceOp(enum.Enum):
    """How a collective combines the ranks' tensors (``rt.Average``, ``rt.Sum``, ``rt.Min``,
    ``rt.Max``)."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX

_TORCH_OPS = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,  # summed, then divided (works for every dtype/backend)
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


def torch_op(op: ReduceOp) -> Any:
    """The ``torch.distributed`` op that implements ``op`` (Average sums; divide after)."""
    if not isinstance(op, ReduceOp):
        raise ConfigError(f"op must be rt.Average, rt.Sum, rt.Min or rt.Max, got {op!r}")
    return _TORCH_OPS[op]


def finish_average(tensor: torch.Tensor, op: ReduceOp, world_size: int) -> None:
    """Turn a sum into an average in place (integer tensors truncate toward zero, as
    Horovod's C++ integer division does)."""
    if op is ReduceOp.AVERAGE and world_size > 1:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(world_size)
        else:
            tensor.copy_(torch.div(tensor, world_size, rounding_mode="trunc"))


class Handle:
    """An exchange in flight; :meth:`wait` (or :func:`synchronize`) returns its result."""

    def __init__(self, tensor: torch.Tensor, wait_fn: Callable[[], None], name: str | None) -> None:
        self.tensor = tensor
        self.name = name
        self._wait_fn: Callable[[], None] | None = wait_fn
        self._error: Exception | None = None

    def done(self) -> bool:
        return self._wait_fn is None

    def wait(self) -> torch.Tensor:
        """The result; the exchange's error if it failed (again on every later call: the
        tensor then holds a partial result, which a second wait returned as if finished)."""
        if self._error is not None:
            raise self._error
        if self._wait_fn is not None:
            fn, self._wait_fn = self._wait_fn, None
            try:
                fn()
            except Exception as exc:
                self._error = exc
                raise
            except BaseException:
                self._wait_fn = fn  # interrupted (Ctrl-C) while waiting: it may be waited for again
                raise
        return self.tensor


class AllreduceAlgorithm(Protocol):
    """An in-place allreduce that may return before it finishes."""

    def __call__(self, tensor: torch.Tensor, op: ReduceOp, name: str | None) -> Handle: ...


def _describe(name: str | None, tensor: torch.Tensor | None = None) -> str:
    if name:
        return repr(name)
    if tensor is not None:
        return f"tensor of shape {tuple(tensor.shape)} and dtype {tensor.dtype}"
    return "an unnamed tensor"


def _fail(what: str, name: str | None, tensor: torch.Tensor | None, exc: Exception) -> CollectiveError:
    return CollectiveError(
        f"{what} of {_describe(name, tensor)} failed on rank {runtime.rank()}: {first_line(exc, None)}"
    )


def staged(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor to hand the backend: NCCL moves only CUDA tensors, so a CPU tensor
    (a metric, a checkpoint's bytes) travels through this rank's GPU; and the backends
    read a tensor's storage as if it were dense, so a strided view (``t[::2]``) travels
    as a dense copy (Gloo reduced the wrong elements of one: pytorch's own
    ``dist.all_reduce`` does too). Callers copy the result back when it is not
    ``tensor``."""
    if tensor.device.type == "cpu" and runtime.world().backend == "nccl":
        return tensor.to(runtime.device(), memory_format=torch.contiguous_format)
    return tensor.contiguous()


# How an ``algorithm=`` name becomes an allreduce: the strategy table of
# :mod:`ringtrain.sync`, a layer below this one, so ``rt.init()`` hands it in
# (:mod:`ringtrain.wiring`) rather than this module importing it.
_resolver: Callable[[str | AllreduceAlgorithm], AllreduceAlgorithm] | None = None


def set_algorithm_resolver(fn: Callable[[str | AllreduceAlgorithm], AllreduceAlgorithm] | None) -> None:
    """Install the name -> algorithm lookup (done by ``rt.init()``)."""
    global _resolver
    _resolver = fn


def _algorithm(name: str | AllreduceAlgorithm) -> AllreduceAlgorithm:
    if _resolver is None:
        raise NotInitializedError("ringtrain is not initialised; call rt.init() first")
    return _resolver(name)


def _op_code(op: ReduceOp) -> int:
    torch_op(op)  # validates
    return agreement.op_code(op.value)


def _variant(algorithm: str | AllreduceAlgorithm) -> str:
    """What identifies an allreduce algorithm across ranks (name and options)."""
    if isinstance(algorithm, str):
        return algorithm
    sig = getattr(algorithm, "signature", None)
    if callable(sig):
        return " ".join(f"{k}={v}" for k, v in sorted(sig().items()))
    return str(getattr(algorithm, "__qualname__", type(algorithm).__qualname__))


def _agree(kind: str, tensor: torch.Tensor, name: str | None, **fields: Any) -> list[agreement.Header]:
    """Compare what every rank submits (see :mod:`ringtrain.agreement`)."""
    w = runtime.world()
    if w.env.size == 1:
        return []
    device = runtime.device() if w.backend == "nccl" else None
    check = f"{name or _describe(name, tensor)} ({kind} check)"

    def exchange(table: torch.Tensor) -> None:
        # The native strategy: a rank that never comes is named after stall_timeout.
        _algorithm("native")(table, Sum, check).wait()

    try:
        return agreement.agree(kind, tensor, w.env.size, w.env.rank, name, device=device,
                               exchange=exchange, **fields)
    except RuntimeError as exc:
        if isinstance(exc, CollectiveError):
            raise
        raise _fail(kind, name, tensor, exc) from exc


# Averages whose sum can leave the dtype's range although the mean cannot: int8 at 3
# ranks averaged 100, 101, 102 to 15, and float16 30000 on 3 ranks to inf. They are
# summed in a wider dtype and narrowed once, after the division (ringtrain.horovod
# widens its small integers the same way). bfloat16 has float32's range. The cost: twice
# (float16) or 8x (int8) the bytes, for averages of these dtypes only.
_WIDER = {torch.int8: torch.int64, torch.uint8: torch.int64, torch.int16: torch.int64,
          torch.float16: torch.float32}


def _wider(tensor: torch.Tensor, op: ReduceOp) -> torch.dtype | None:
    return _WIDER.get(tensor.dtype) if op is ReduceOp.AVERAGE and runtime.size() > 1 else None


def _reduce_problem(kind: str, tensor: torch.Tensor, op: ReduceOp, name: str | None) -> str | None:
    """What is wrong with reducing ``tensor`` by ``op`` on this rank alone, if anything."""
    if not isinstance(op, ReduceOp):
        return None  # torch_op() raises its own error first
    if tensor.dtype == torch.bool and op is ReduceOp.AVERAGE:
        # The sum of bools is their OR, so the mean came out False where every rank had True.
        return (f"{kind} of {_describe(name, tensor)} cannot average a bool tensor; "
                "use op=rt.Max (any rank), rt.Min (every rank) or cast it to a number first")
    if tensor.is_complex() and op in (ReduceOp.MIN, ReduceOp.MAX):
        return (f"{kind} of {_describe(name, tensor)} cannot take the {op.value} of a complex "
                "tensor (complex numbers have no order); use rt.Sum or rt.Average, or reduce .abs()")
    return None


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """Whether elements of ``tensor`` share memory (an ``expand()``-ed view, stride 0):
    an in-place result cannot be written into it."""
    if tensor.layout != torch.strided:
        return False
    check = getattr(torch, "_debug_has_internal_overlap", None)
    if check is not None:
        return int(check(tensor)) == 1  # 2 is "too hard to tell": copy_ accepts those
    return any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape, strict=True))


def _overlap_problem(kind: str, tensor: torch.Tensor, name: str | None) -> str | None:
    """An in-place result cannot be written where elements share memory (``expand()``):
    torch refused the copy back after the exchange, on every rank, with a traceback."""
    if has_internal_overlap(tensor):
        return (f"{kind} of {_describe(name, tensor)} writes its result in place, but elements of "
                f"the tensor (shape {tuple(tensor.shape)}, strides {tensor.stride()}) share memory, "
                "as after expand(); pass tensor.clone(), or use the out-of-place form")
    return None


def _refuse_alone(problem: str | None) -> None:
    """One rank has nobody to tell: its problem is an error at once (others go through
    the header exchange, so that every rank raises it)."""
    if problem is not None and runtime.size() == 1:
        raise ConfigError(problem)


def barrier() -> None:
    runtime.world()
    dist.barrier()


def allreduce_async_(
    tensor: torch.Tensor,
    op: ReduceOp = Average,
    name: str | None = None,
    algorithm: str | AllreduceAlgorithm = "native",
) -> Handle:
    runtime.world()
    fn = _algorithm(algorithm)
    label = _variant(algorithm)
    code = _op_code(op)
    problem = _reduce_problem("allreduce", tensor, op, name) or _overlap_problem("allreduce", tensor, name)
    _refuse_alone(problem)
    _agree("allreduce", tensor, name, op=code, variant=agreement.variant_code(label),
           variant_label=label, problem=problem)
    wide = _wider(tensor, op)
    if wide is None:
        return fn(tensor, op, name)
    work = tensor.detach().to(wide)
    inner = fn(work, op, name)

    def narrow() -> None:
        inner.wait()
        tensor.detach().copy_(work)  # outside autograd, as the strategies write (a parameter too)

    return Handle(tensor, narrow, name)


def allreduce_async(
    tensor: torch.Tensor,
    op: ReduceOp = Average,
    name: str | None = None,
    algorithm: str | AllreduceAlgorithm = "native",
) -> Handle:
    return allreduce_async_(tensor.detach().clone(), op, name, algorithm)


def synchronize(handle: Handle) -> torch.Tensor:
    return handle.wait()


def allreduce_(
    tensor: torch.Tensor,
    op: ReduceOp = Average,
    name: str | None = None,
    algorithm: str | AllreduceAlgorithm = "native",
) -> torch.Tensor:
    return allreduce_async_(tensor, op, name, algorithm).wait()


def allreduce(
    tensor: torch.Tensor,
    op: ReduceOp = Average,
    name: str | None = None,
    algorithm: str | AllreduceAlgorithm = "native",
) -> torch.Tensor:
    return allreduce_async(tensor, op, name, algorithm).wait()


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0; first dimensions may differ by rank."""
    n = runtime.size()
    t = staged(tensor.detach().contiguous())
    if t.dim() == 0:
        t = t.reshape(1)
    headers = _agree("allgather", t, name)
    sizes = [h.rows for h in headers] if headers else [t.shape[0]]
    try:
        longest = max(sizes)
        if t.shape[0] < longest:
            pad = torch.zeros((longest - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
            t = torch.cat([t, pad])
        parts = [torch.empty_like(t) for _ in range(n)]
        inflight.hold(t, *parts)
        dist.all_gather(parts, t)
    except RuntimeError as exc:
        raise _fail("allgather", name, tensor, exc) from exc
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=False)]).to(tensor.device)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    n = runtime.size()
    problem = None
    if not (isinstance(root_rank, int) and 0 <= root_rank < n):
        problem = f"root_rank {root_rank} is outside the world of size {n}"
        if n == 1:
            raise ConfigError(problem)
        root_rank = 0
    problem = problem or _overlap_problem("broadcast_", tensor, name)
    _refuse_alone(problem)
    _agree("broadcast", tensor, name, root=root_rank, problem=problem)
    comm = staged(tensor)
    inflight.hold(comm)
    try:
        dist.broadcast(comm, src=root_rank)
    except RuntimeError as exc:
        raise _fail("broadcast", name, tensor, exc) from exc
    if comm is not tensor:
        # Outside autograd, as dist.broadcast writes a contiguous tensor: a parameter that
        # is not contiguous (a channels_last conv weight, a transposed weight) raised "a
        # leaf Variable that requires grad is being used in an in-place operation" here,
        # on every rank, where torch's dist.broadcast(param) succeeds.
        tensor.detach().copy_(comm)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    return broadcast_(tensor.detach().clone(), root_rank, name)


def _even_splits(length: int, parts: int) -> list[int]:
    # The first (length % parts) ranks get one extra row, as Horovod does.
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def alltoall(
    tensor: torch.Tensor, splits: Sequence[int] | None = None, name: str | None = None
) -> torch.Tensor:
    """Send ``splits[i]`` rows (dim 0) to rank i; return the rows received, in rank order."""
    n = runtime.size()
    t = staged(tensor.detach().contiguous())
    problem = None
    if t.dim() == 0:  # an IndexError on every rank before
        problem = f"alltoall splits dim 0, but {_describe(name, tensor)} is a scalar"
        _refuse_alone(problem)
        t = t.reshape(1)
    send = list(splits) if splits is not None else _even_splits(t.shape[0], n)
    if problem is not None:
        send = [0] * n
    elif len(send) != n or any(s < 0 for s in send) or sum(send) != t.shape[0]:
        problem = (f"alltoall splits {send} must be {n} non-negative numbers summing to the "
                   f"first dimension {t.shape[0]}")
        if n == 1:
            raise ConfigError(problem)
        send = [0] * n
    headers = _agree("alltoall", t, name, extra=send, problem=problem)
    me = runtime.rank()
    recv = [h.extra[me] for h in headers] if headers else list(send)
    try:
        out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype, device=t.device)
        inflight.hold(out, t)
        dist.all_to_all_single(out, t, output_split_sizes=recv, input_split_sizes=send)
    except RuntimeError as exc:
        raise _fail("alltoall", name, tensor, exc) from exc
    return out.to(tensor.device)


def reducescatter(tensor: torch.Tensor, op: ReduceOp = Average, name: str | None = None) -> torch.Tensor:
    """Reduce across ranks and keep this rank's share of dim 0 (earlier ranks get the
    extra rows). Each rank receives only its share: (N-1)/N of the tensor crosses each
    link, half of what an allreduce would move."""
    n, r = runtime.size(), runtime.rank()
    t = tensor.detach()
    code = _op_code(op)
    problem = None
    if t.dim() == 0:
        problem = f"reducescatter splits dim 0, but {_describe(name, tensor)} is a scalar"
        t = t.reshape(1)
    problem = problem or _reduce_problem("reducescatter", t, op, name)
    _refuse_alone(problem)
    _agree("reducescatter", t, name, op=code, problem=problem)
    splits = _even_splits(t.shape[0], n)
    wide = _wider(t, op)
    comm = staged(t.to(wide) if wide is not None else t.contiguous())
    parts = list(torch.split(comm, splits))
    out = torch.empty_like(parts[r])
    pieces = [p.contiguous() for p in parts]
    inflight.hold(out, *pieces)
    try:
        # The list form takes uneven shares (the single-tensor form needs N equal ones).
        dist.reduce_scatter(out, pieces, op=torch_op(op))
    except RuntimeError as exc:
        raise _fail("reducescatter", name, tensor, exc) from exc
    finish_average(out, op, n)
    return out.to(device=tensor.device, dtype=tensor.dtype)


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _pickle_or_problem(obj: Any, what: str) -> tuple[torch.Tensor, str | None]:
    """The pickled bytes, or (empty, why not): a rank that cannot pickle its object
    tells the others, so every rank raises the same error (before, it raised alone and
    the others stalled or met its next collective as a mismatch)."""
    try:
        return _pickled(obj), None
    except Exception as exc:  # noqa: BLE001 - pickle raises TypeError, PicklingError, AttributeError...
        return torch.empty(0, dtype=torch.uint8), f"{what} cannot pickle {type(obj).__name__}: {first_line(exc, None)}"


def _text(data: str) -> torch.Tensor:
    raw = data.encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """The root's ``obj`` (pickled) on every rank.

    Written on ringtrain's own broadcasts (not ``broadcast_object_list``), so the bytes
    travel in tensors ringtrain keeps until Gloo lets go of them (:mod:`ringtrain.inflight`).
    A root outside the world (on any rank) or an object the root cannot pickle is the
    same ConfigError on every rank."""
    n = runtime.size()
    if n == 1:
        if not (isinstance(root_rank, int) and 0 <= root_rank < n):
            raise ConfigError(f"root_rank {root_rank} is outside the world of size {n}")
        return obj
    label = name or "object"
    me = runtime.rank()
    data, problem = torch.empty(0, dtype=torch.uint8), None
    if me == root_rank:
        data, problem = _pickle_or_problem(obj, f"broadcast_object of {label!r} on root rank {me}")
        if problem is not None:
            data = _text(problem)
    # A negative size says the root failed and |size| bytes of its message follow. A
    # bad root_rank is refused by the first broadcast_, on every rank.
    size = torch.tensor([data.numel() * (-1 if problem is not None else 1)], dtype=torch.int64)
    broadcast_(size, root_rank, name=f"{label} (size)")
    length = int(size.item())
    if me != root_rank:
        data = torch.empty(abs(length), dtype=torch.uint8)
    broadcast_(data, root_rank, name=f"{label} (bytes)")
    if length < 0:
        raise ConfigError(data.numpy().tobytes().decode(errors="replace"))
    return obj if me == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, by rank (pickled; see :func:`broadcast_object`). An object
    some rank cannot pickle is the same ConfigError on every rank."""
    if runtime.size() == 1:
        return [obj]
    label = name or "object"
    data, problem = _pickle_or_problem(obj, f"allgather_object of {label!r} on rank {runtime.rank()}")
    # -1: this rank could not pickle; every rank then gathers the reasons instead.
    mine = torch.tensor([data.numel() if problem is None else -1], dtype=torch.int64)
    sizes = allgather(mine, name=f"{label} (sizes)")
    if (sizes < 0).any():
        texts = allgather(_text(problem or ""), name=f"{label} (errors)")
        lengths = allgather(torch.tensor([len((problem or "").encode())], dtype=torch.int64),
                            name=f"{label} (error sizes)")
        parts = torch.split(texts, lengths.tolist())
        raise ConfigError("; ".join(p.numpy().tobytes().decode(errors="replace") for p in parts if p.numel()))
    gathered = allgather(data, name=f"{label} (bytes)")
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(gathered[offset:offset + n].numpy().tobytes()))
        offset += n
    return out
