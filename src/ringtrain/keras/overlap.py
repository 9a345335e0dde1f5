"""Start each bucket's exchange during backward, as its gradients become ready.

Keras' torch trainer runs ``loss.backward()`` and then ``optimizer.apply(grads,
variables)``. Waiting for ``apply`` to start the exchange leaves the network idle for
the whole backward pass; the torch :class:`ringtrain.DistributedOptimizer` instead
starts a bucket as soon as autograd has accumulated the last of its gradients. This
module does the same for :class:`ringtrain.keras.GradientExchange`: a post-accumulate
hook on each variable's torch tensor records the gradient and, once every member of a
bucket is in, packs and launches the bucket, strictly in plan order so every rank
issues the same sequence. ``apply`` then launches what is left (variables that got no
gradient contribute zeros) and waits.

The hooks are attached after the first step (its layout check and exchange run after
backward), so from the second step on every rank overlaps the same way. Rules that keep
ranks in step:

- ``apply`` must receive the gradients backward left in ``.grad`` (Keras' own
  ``train_step`` passes exactly those). If it receives other tensors, the exchanges
  already launched are finished and discarded and the given gradients are exchanged
  after all (a warning says so, once): correct, but twice the traffic. A ``train_step``
  that changes gradients *in place* before ``apply`` must pass ``overlap=False``: the
  exchange has read them already (the torch optimizer has the same rule, which is why
  it offers ``synchronize()``).
- One set of hooks per variable: a newer exchange over the same variables (the model
  recompiled with another optimizer) detaches the older one (finishing what it had in
  flight); used again, the older one exchanges one step after backward and takes the
  hooks back.
- A backward that reaches a variable twice before ``apply`` (two backward passes with
  no update between them) finishes the exchanges of the first one and starts over.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from ringtrain.fusion import FusedExchange

__all__ = ["BackwardOverlap"]

# The attribute on a variable's tensor naming the overlap whose hooks it carries.
_OWNER = "_ringtrain_keras_overlap"


class BackwardOverlap:
    """Post-accumulate hooks that launch the buckets of ``fusion`` during backward.

    ``due()`` says whether the running backward pass is the one whose gradients get
    exchanged (the last of ``backward_passes_per_step``); ``source(i, grad)`` turns the
    i-th gradient into what is exchanged (the gradient, or the local sum including it).
    """

    def __init__(self, fusion: FusedExchange, params: Sequence[torch.Tensor],
                 due: Callable[[], bool], source: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        self.fusion = fusion
        self.params = list(params)
        self._due = due
        self._source = source
        self._lock = threading.Lock()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._reset()

    # -- lifetime ------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        """Hook every variable autograd accumulates into (detaching any older overlap
        that hooked one of them). Plain tensors (a custom loop's) get no hook: their
        buckets go at :meth:`finish`."""
        hookable = [i for i, p in enumerate(self.params) if p.requires_grad and p.is_leaf]
        for i in hookable:
            old = getattr(self.params[i], _OWNER, None)
            if old is not None and old is not self:
                old.detach()
        self._handles = [self.params[i].register_post_accumulate_grad_hook(self._hook(i))
                         for i in hookable]
        for i in hookable:
            setattr(self.params[i], _OWNER, self)

    def detach(self) -> None:
        """Finish what is in flight (every rank launched it) and remove the hooks."""
        self.drain()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for p in self.params:
            if getattr(p, _OWNER, None) is self:
                delattr(p, _OWNER)

    # -- one step ------------------------------------------------------------------------

    def _reset(self) -> None:
        self._seen: list[torch.Tensor | None] = [None] * len(self.params)
        self._sources: list[torch.Tensor | None] = [None] * len(self.params)
        self._next = 0
        for bucket in self.fusion.buckets:
            bucket.pending = len(bucket.spec.params)
            bucket.handle = None

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None and self._due():
                self._ready(index, param.grad)

        return hook

    def _ready(self, index: int, grad: torch.Tensor) -> None:
        with self._lock:
            if self._seen[index] is not None:
                self._drain_locked()  # a second backward before apply: start over
            self._seen[index] = grad
            with torch.no_grad():
                self._sources[index] = self._source(index, grad)
            bucket, _ = self.fusion.bucket_of[index]
            bucket.pending -= 1
            self._launch(None)

    def _launch(self, rest: Sequence[torch.Tensor | None] | None) -> None:
        """Launch buckets in plan order: those complete, or (``rest`` given) all of them,
        taking ``rest[i]`` for a member whose hook did not run."""
        buckets = self.fusion.buckets
        while self._next < len(buckets):
            bucket = buckets[self._next]
            if rest is None and bucket.pending > 0:
                return
            members = bucket.spec.params
            grads = [self._sources[i] if self._sources[i] is not None
                     else (rest[i] if rest is not None else None) for i in members]
            with torch.no_grad():
                self.fusion.pack(bucket, grads)
            self.fusion.launch(bucket)
            self._next += 1

    def started(self) -> bool:
        """Whether this backward pass has handed over any gradient."""
        return any(g is not None for g in self._seen)

    def seen(self, index: int) -> bool:
        """Whether the hook of tensor ``index`` handed over its gradient in this pass."""
        return self._seen[index] is not None

    def matches(self, grads: Sequence[torch.Tensor | None]) -> bool:
        """Whether ``grads`` are the tensors the hooks saw (Keras' train_step passes them)."""
        return all(seen is None or seen is g for seen, g in zip(self._seen, grads, strict=True))

    def finish(self, rest: Sequence[torch.Tensor | None]) -> None:
        """Launch every bucket not launched yet (``rest`` for members without a hook call);
        the caller then waits for the buckets and calls :meth:`done`."""
        with self._lock:
            self._launch(rest)

    def done(self) -> None:
        """The results were taken: the next backward pass starts a new step."""
        with self._lock:
            self._reset()

    def drain(self) -> None:
        """Finish and discard the exchanges this backward launched."""
        with self._lock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        for bucket in self.fusion.buckets[: self._next]:
            if bucket.handle is not None:
                self.fusion.wait(bucket)
        self._reset()
