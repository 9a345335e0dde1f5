"""What a rank asks the coordinator for, and the pure rules applied to what all asked.

A :class:`Meta` is one rank's description of one named operation (no tensor data); the
ranks exchange them every cycle. Two pure functions decide, identically on every rank
from the same gathered metas: :func:`mismatch` (the error every rank raises when the
ranks asked for different things under one name) and :func:`fusable` (which ready
allreduces share one flat buffer).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

from ringtrain.agreement import group_ranks
from ringtrain.errors import ranks_phrase

__all__ = ["KINDS", "REDUCING", "Meta", "fusable", "mismatch"]

#: Operations the coordinator runs.
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")
#: Kinds whose ranks contribute to a reduction (a joined rank contributes zeros there).
REDUCING = ("allreduce", "reducescatter")


@dataclass(frozen=True)
class Meta:
    """One rank's request, as the other ranks see it."""

    name: str
    kind: str
    set_id: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()
    op: str = ""  #: "sum", "average", "min", "max", "product", "adasum" (reductions)
    root: int = -1  #: broadcast: the root's global rank
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = "cpu"  #: "cpu" or "cuda"
    #: alltoall: rows sent to each member of the set (may differ by rank)
    splits: tuple[int, ...] = field(default=(), compare=False)
    #: why this rank cannot take part (its error, already raised there): every member
    #: gets it, instead of running the operation without this rank's side
    refused: str = field(default="", compare=False)

    @property
    def key(self) -> tuple[int, str]:
        """What identifies the operation: names are per process set."""
        return (self.set_id, self.name)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEMSIZE.get(self.dtype, 8)


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1,
             "int16": 2, "int32": 4, "int64": 8, "bool": 1}


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else str(shape)


def mismatch(metas: Mapping[int, Meta]) -> str | None:
    """None when every rank's request under this name agrees; else the message all
    ranks raise (Horovod's words: "Mismatched allreduce tensor shapes: ...")."""
    if len(metas) <= 1:
        return None
    first = metas[min(metas)]
    name, kind = first.name, first.kind
    checks: list[tuple[str, Callable[[Meta], Hashable], str]] = [
        ("operations", lambda m: m.kind, "every rank must call the same collective under one name"),
        (f"{kind} devices", lambda m: m.device, "place the tensor on the same kind of device "
                                                "on every rank"),
        (f"{kind} tensor types", lambda m: m.dtype, "cast the tensor to one dtype on every rank"),
        (f"{kind} ops", lambda m: m.op, "pass the same op on every rank"),
        (f"{kind} root ranks", lambda m: m.root, "pass the same root_rank on every rank"),
        (f"{kind} scale factors", lambda m: (m.prescale, m.postscale),
         "pass the same prescale_factor and postscale_factor on every rank"),
    ]
    if kind in ("allgather", "alltoall"):
        checks.append((f"{kind} tensor ranks", lambda m: len(m.shape), "every rank must pass a "
                       "tensor with the same number of dimensions"))
        checks.append((f"{kind} tensor shapes", lambda m: m.shape[1:],
                       "only the first dimension may differ between ranks"))
    elif kind != "barrier":
        checks.append((f"{kind} tensor shapes", lambda m: m.shape, "every rank must pass the same shape"))
    for what, key, hint in checks:
        groups = group_ranks(metas, key)
        if len(groups) > 1:
            parts = []
            for rs in groups[:6]:
                value = key(metas[rs[0]])
                if what.endswith("shapes"):
                    shown = _fmt_shape(metas[rs[0]].shape)
                elif what.endswith("scale factors"):
                    shown = f"prescale {metas[rs[0]].prescale:g}, postscale {metas[rs[0]].postscale:g}"
                else:
                    shown = str(value)
                parts.append(f"{shown} on {ranks_phrase(rs)}")
            return f"Mismatched {what} for {name!r}: " + "; ".join(parts) + f" ({hint})"
    return None


def fusable(a: Meta, b: Meta) -> bool:
    """Whether two ready allreduces may travel in one flat buffer."""
    return (a.kind == b.kind == "allreduce" and a.op == b.op and a.op != "adasum"
            and (a.set_id, a.dtype, a.device, a.prescale, a.postscale)
            == (b.set_id, b.dtype, b.device, b.prescale, b.postscale))
