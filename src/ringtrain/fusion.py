"""Fused gradient exchange: gradients travel in a few flat buffers instead of one by one.

Used by every optimizer front end (``rt.DistributedOptimizer``, ``ringtrain.keras``,
``ringtrain.horovod``), so packing, scaling, compression and the first-step signature
are written once:

1. :func:`plan_buckets` decides which gradients share a buffer (a pure function of
   shapes and order, equal on every rank: every rank computes the same plan without
   talking). Gradients become ready roughly in reverse order of registration (backward
   runs from the loss to the input), so buckets are filled from the last parameter
   backwards; the first bucket is then ready earliest and its exchange overlaps the
   rest of backward (the order PyTorch DDP uses).
2. :meth:`FusedExchange.pack` copies a bucket's gradients into its flat buffer in the
   wire dtype, multiplied by the *pre*-scale (``None`` gradients contribute zeros, so
   no rank waits for an exchange that never comes).
3. :meth:`FusedExchange.launch` hands the buffer to the strategy (an in-place
   asynchronous sum across ranks); :meth:`FusedExchange.finish` waits and returns each
   gradient's result, multiplied by the *post*-scale.

Scaling follows Horovod: ``op=Average`` divides the rank-sum by ``size()`` only, and
``gradient_predivide_factor=f`` splits that into 1/f before the sum and f/size after
it. Without an explicit factor, an uncompressed buffer is scaled once, before the sum
(one pass over memory); a compressed one is pre-scaled by the power of two just above
``size()`` (exact in any float format, and it keeps an fp16 sum below 65504 whenever
each rank's gradient is) and the rest is applied after widening back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ringtrain.collectives import Average, Handle, ReduceOp, Sum
from ringtrain.compression import Compressor
from ringtrain.errors import ConfigError

__all__ = ["Bucket", "BucketSpec", "FusedExchange", "Scaling", "plan_buckets", "scaling"]


# -- which gradients travel together ------------------------------------------------------------


@dataclass(frozen=True)
class BucketSpec:
    """One fused buffer: the indices of its parameters (in pack order) and their offsets."""

    index: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device


#: The first bucket is capped lower, as PyTorch DDP does (1 MB), so the exchange starts
#: early in backward instead of waiting for a full 25 MB of gradients.
FIRST_BUCKET_BYTES = 1024 * 1024


def plan_buckets(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    bucket_bytes: int,
    first_bucket_bytes: int | None = None,
) -> list[BucketSpec]:
    """Group parameters (given in registration order) into buckets of at most
    ``bucket_bytes`` each; the first bucket of each dtype/device holds at most
    ``first_bucket_bytes`` (default ``min(1 MB, bucket_bytes)``). A tensor larger than
    its bucket's cap travels alone and closes its bucket at once, so a big layer whose
    gradient is ready early is exchanged while backward goes on."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    if not len(shapes) == len(dtypes) == len(devices):
        raise ValueError("shapes, dtypes and devices must have the same length")
    first = min(FIRST_BUCKET_BYTES if first_bucket_bytes is None else first_bucket_bytes,
                bucket_bytes)
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    cap_of: dict[tuple[torch.dtype, torch.device], int] = {}  # cap of the open bucket
    closed: list[list[int]] = []
    for i in reversed(range(len(shapes))):
        key = (dtypes[i], devices[i])
        size = int(torch.Size(shapes[i]).numel()) * torch.empty((), dtype=dtypes[i]).element_size()
        current = open_buckets.setdefault(key, [])
        if current and open_bytes[key] + size > cap_of[key]:
            closed.append(current)
            current = open_buckets[key] = []
        if not current:
            cap_of[key] = first if key not in cap_of else bucket_bytes
            open_bytes[key] = 0
        current.append(i)
        open_bytes[key] += size
        if size > cap_of[key] or size >= first:
            # A tensor of a megabyte or more is bandwidth-bound on its own: send it as soon
            # as it is ready instead of holding it for the smaller gradients after it.
            closed.append(current)
            open_buckets[key] = []
    closed.extend(b for b in open_buckets.values() if b)
    # Order buckets by when they fill: the one holding the latest-registered parameter
    # (ready first in backward) comes first.
    closed.sort(key=lambda b: -b[0])
    specs = []
    for index, members in enumerate(closed):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += int(torch.Size(shapes[i]).numel())
        specs.append(
            BucketSpec(index, tuple(members), tuple(offsets), total, dtypes[members[0]], devices[members[0]])
        )
    return specs


# -- packing, exchanging, unpacking ----------------------------------------------------------------


#: ``strategy(flat, op, name) -> Handle``: an in-place, possibly asynchronous allreduce.
Exchange = Callable[[torch.Tensor, ReduceOp, str | None], Handle]


@dataclass(frozen=True)
class Scaling:
    """Factors applied to a gradient before it goes on the wire and after it comes back."""

    pre: float = 1.0
    post: float = 1.0


def scaling(op: ReduceOp, size: int, compressed: bool, predivide: float | None = None) -> Scaling:
    """How a bucket is scaled so the rank-sum becomes ``op``'s result (see module doc)."""
    if op is Sum:
        if predivide not in (None, 1.0):
            raise ConfigError(
                f"gradient_predivide_factor={predivide} only applies to op=Average (as in Horovod); "
                "leave it at 1.0 with op=Sum"
            )
        return Scaling()
    if op is not Average:
        raise ConfigError(f"gradients are combined with op=Average or op=Sum, got {op!r}")
    if predivide is not None and predivide != 1.0:
        if not (predivide > 0 and math.isfinite(predivide)):
            raise ConfigError(f"gradient_predivide_factor must be a finite number > 0, got {predivide}")
        return Scaling(pre=1.0 / predivide, post=predivide / size)
    if not compressed:
        return Scaling(pre=1.0 / size)
    pre = 2.0 ** -math.ceil(math.log2(size)) if size > 1 else 1.0
    return Scaling(pre=pre, post=(1.0 / size) / pre)


class Bucket:
    """One flat buffer and the exchange of it in flight."""

    def __init__(self, spec: BucketSpec, names: Sequence[str], numels: Sequence[int],
                 wire: torch.dtype, label: str, track_use: bool = False) -> None:
        self.spec = spec
        self.numels = tuple(numels)
        #: With ``track_use``, one more element per member after the gradients: 1 where
        #: this rank had a gradient, summed with them (see ``FusedExchange.unused``).
        self.uses = len(spec.params) if track_use else 0
        self.flat = torch.zeros(spec.numel + self.uses, dtype=wire, device=spec.device)
        #: Positions of the members packed without a gradient this step (``track_use``).
        self.local_none: list[int] = []
        #: Whether the gradients can *be* views of the buffer (no compression), as DDP's
        #: ``gradient_as_bucket_view``: packing is then at most one copy, unpacking none.
        self.grad_views = wire == spec.dtype
        #: The buffer the gradients stay in while ``flat`` is exchanged (see ``pack``'s
        #: ``keep_grads``); the two swap roles each step.
        self.spare: torch.Tensor | None = None
        self.pending = len(spec.params)  # members not yet ready in this step
        self.handle: Handle | None = None
        self.launched_at = 0.0
        first, last = names[0], names[-1]
        more = f"..{last}" if len(names) > 1 else ""
        self.name = f"{label}{spec.index}[{first}{more}]"

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def view(self, position: int) -> torch.Tensor:
        """The flat slice of the ``position``-th member (1-D, wire dtype)."""
        offset = self.spec.offsets[position]
        return self.flat[offset : offset + self.numels[position]]


def _held_elsewhere(flat: torch.Tensor, grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether a tensor other than ``flat`` and this step's ``grads`` uses ``flat``'s memory.

    Counts the references to the buffer's storage: one for ``flat``, one for each gradient
    that is a view of it (accumulated in place), one for the temporary storage object
    this check makes. Without torch's counter, a buffer is replaced whenever a gradient
    is not already its view (correct, one allocation per bucket and step)."""
    mine = _views(flat, grads)
    storage = flat.untyped_storage()
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:
        return mine < len(grads)
    return int(counter(storage._cdata)) > 2 + mine


def _views(flat: torch.Tensor, grads: Sequence[torch.Tensor | None]) -> int:
    """How many of ``grads`` lie in ``flat``'s memory (views of it)."""
    lo = flat.data_ptr()
    hi = lo + flat.numel() * flat.element_size()
    return sum(1 for g in grads if g is not None and not g.is_sparse and lo <= g.data_ptr() < hi)


def _is_view_of(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return (grad.dtype == view.dtype and grad.is_contiguous()
            and grad.data_ptr() == view.data_ptr() and grad.numel() == view.numel())


class FusedExchange:
    """Buckets for a fixed list of tensors and their scaled, compressed exchange."""

    def __init__(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        strategy: Exchange,
        compression: Compressor,
        op: ReduceOp,
        size: int,
        bucket_bytes: int,
        predivide: float | None = None,
        label: str = "bucket",
        track_use: bool = False,
    ) -> None:
        """``track_use``: also exchange which members had a gradient on any rank (see
        :meth:`unused`), one element per member, as DDP's used-parameter map."""
        if bucket_bytes <= 0:
            raise ConfigError(f"fusion_mb must be > 0, got {bucket_bytes / 2**20:g}")
        self.names = list(names)
        self.shapes = [tuple(t.shape) for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self.devices = [t.device for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.strategy = strategy
        self.compression = compression
        self.op = op
        self.size = size
        self.predivide = predivide
        self.bucket_bytes = bucket_bytes
        self.label = label
        self.track_use = track_use
        scaling(op, size, False, predivide)  # validates op and the factor now, not mid-step
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, tuple[Bucket, int]] = {}
        self.members: list[int] = []
        #: Buffers replaced because a view of the old one was still held (see pack).
        self.fresh_buffers = 0
        self.plan(range(len(tensors)))

    def plan(self, members: Sequence[int] | range) -> None:
        """(Re)build the buckets for the tensors ``members`` (indices into the full list);
        the others stay out of the fused exchange (e.g. sparse gradients)."""
        keep = list(members)
        specs = plan_buckets([self.shapes[i] for i in keep], [self.dtypes[i] for i in keep],
                             [self.devices[i] for i in keep], self.bucket_bytes)
        self.buckets = []
        self.bucket_of = {}
        for spec in specs:
            # The plan speaks of positions in `keep`; buckets hold the real indices.
            real = tuple(keep[p] for p in spec.params)
            spec = BucketSpec(spec.index, real, spec.offsets, spec.numel, spec.dtype, spec.device)
            # Alone (one rank, or a process set of one) nothing goes on the wire, so
            # nothing is compressed: Horovod registers no hooks at size() == 1 and a script
            # run alone keeps its exact gradients. Narrowed, fp16 turned 70000 into inf and
            # 1.2345678 into 1.234375 although no byte was exchanged.
            wire = spec.dtype if self.size == 1 else self.compression.wire_dtype_for(spec.dtype)
            bucket = Bucket(spec, [self.names[i] for i in real], [self.numels[i] for i in real],
                            wire, self.label, self.track_use)
            self.buckets.append(bucket)
            for position, index in enumerate(real):
                self.bucket_of[index] = (bucket, position)
        self.members = keep

    def add(self, names: Sequence[str], tensors: Sequence[torch.Tensor], members: Sequence[int]) -> None:
        """Append tensors to the full list (indices continue after the existing ones) and
        re-plan the buckets for ``members``."""
        self.names.extend(names)
        self.shapes.extend(tuple(t.shape) for t in tensors)
        self.dtypes.extend(t.dtype for t in tensors)
        self.devices.extend(t.device for t in tensors)
        self.numels.extend(t.numel() for t in tensors)
        self.plan(members)

    # -- the exchange -------------------------------------------------------------------

    def scaling_for(self, bucket: Bucket) -> Scaling:
        return scaling(self.op, self.size, not bucket.grad_views, self.predivide)

    def pack(self, bucket: Bucket, grads: Sequence[torch.Tensor | None],
             keep_grads: bool = False) -> list[torch.Tensor]:
        """Fill ``bucket.flat`` from ``grads`` (one per member, dense; ``None`` contributes
        zeros), pre-scaled; returns each member's view of the buffer, shaped like it.

        A gradient that already is its view (accumulated in place) is not copied, unless
        ``keep_grads``: the gradients must then stay as they are, unscaled and out of the
        exchange's way, until it is done (Horovod's contract: the script may read or clip
        them before ``synchronize()``), so the buffer they are views of becomes the
        bucket's spare and the exchange takes the other one.
        """
        pre = self.scaling_for(bucket).pre
        if keep_grads and bucket.grad_views and _views(bucket.flat, grads):
            spare = bucket.spare if bucket.spare is not None else torch.empty_like(bucket.flat)
            bucket.flat, bucket.spare = spare, bucket.flat
        if bucket.grad_views and _held_elsewhere(bucket.flat, grads):
            # A view of the buffer from an earlier step outlives it (the script kept a
            # `.grad` tensor, or an optimizer stored one): overwriting the buffer would
            # change that tensor, where DDP and Horovod leave an old gradient as it was.
            # Pack into a new buffer; the old one stays with whoever holds it.
            bucket.flat = torch.empty_like(bucket.flat)
            self.fresh_buffers += 1
        with torch.no_grad():
            for position, grad in enumerate(grads):
                view = bucket.view(position)
                if grad is None:
                    view.zero_()  # no gradient: contribute zeros, never skip the exchange
                elif _is_view_of(grad, view):
                    if pre != 1.0:
                        view.mul_(pre)
                else:
                    g = grad.detach().reshape(-1)
                    if pre == 1.0:
                        view.copy_(g)
                    elif view.dtype == g.dtype:
                        torch.mul(g, pre, out=view)
                    else:
                        view.copy_(g * pre)  # scale before narrowing: fp16 overflows at 65504
            if bucket.uses:
                bucket.local_none = [p for p, grad in enumerate(grads) if grad is None]
                tail = bucket.flat[bucket.spec.numel:]
                if bucket.local_none:
                    flags = torch.ones(bucket.uses, dtype=tail.dtype)
                    flags[bucket.local_none] = 0
                    tail.copy_(flags)
                else:
                    tail.fill_(1)  # the usual step: one fill, no copy from the host
        return [bucket.view(p).view(self.shapes[i]) for p, i in enumerate(bucket.spec.params)]

    def unused(self, bucket: Bucket) -> list[int]:
        """After :meth:`wait`: the positions of the members no rank had a gradient for
        this step. Only a rank that had none for some member looks (one copy of the
        flags to the host), and every rank that had one knows it was used, so all ranks
        agree without more exchange."""
        if not bucket.local_none:
            return []
        counts = bucket.flat[bucket.spec.numel:].tolist()
        return [p for p in bucket.local_none if counts[p] == 0]

    def launch(self, bucket: Bucket) -> None:
        """Start the bucket's in-place sum across ranks (may return before it is done)."""
        bucket.launched_at = time.perf_counter()
        bucket.handle = self.strategy(bucket.flat, Sum, bucket.name)

    def wait(self, bucket: Bucket) -> None:
        """Wait for the bucket's sum; an uncompressed buffer (whose members may be the
        gradients themselves) gets its post-scale here, in place."""
        if bucket.handle is None:
            raise RuntimeError(f"{bucket.name} was never launched")
        handle, bucket.handle = bucket.handle, None
        handle.wait()
        post = self.scaling_for(bucket).post
        if post != 1.0 and bucket.grad_views:
            bucket.flat.mul_(post)

    def result(self, bucket: Bucket, position: int) -> torch.Tensor:
        """The ``position``-th member's reduced gradient in its own dtype and shape (a view
        of the buffer when uncompressed, else a widened, post-scaled copy)."""
        index = bucket.spec.params[position]
        view = bucket.view(position).view(self.shapes[index])
        if bucket.grad_views:
            return view
        out = view.to(self.dtypes[index])
        post = self.scaling_for(bucket).post
        if post != 1.0:
            out.mul_(post)
        return out

    # -- what ranks must agree on ---------------------------------------------------------

    def signature(self) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict[str, str]]:
        """(tensors in exchange order, shared settings) for the first-step check."""
        tensors = [(self.names[i], self.shapes[i], self.dtypes[i])
                   for b in self.buckets for i in b.spec.params]
        settings = {
            "op": self.op.name,
            "compression": self.compression.name,
            "gradient_predivide_factor": repr(1.0 if self.predivide is None else self.predivide),
            "buckets": " ".join(str(b.spec.numel) for b in self.buckets),
        }
        return tensors, settings
