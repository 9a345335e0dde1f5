"""``parallelize``: lay the ranks out as a mesh, apply the techniques, run a step.

The order of application follows torchtitan's (each engine expects the previous one's
output): cut the pipeline stage, split layers over the tensor group (DTensor), shard
what remains over the data group (FSDP2), build the stage's schedule. Everything a
layout can get wrong is checked first, identically on every rank, so a bad layout is
one :class:`ConfigError` everywhere before any collective starts.

One step::

    par = parallelize(model, loss_fn, pipeline=2, tensor=2, shard=True)
    opt = torch.optim.AdamW(par.parameters(), lr=3e-4)
    x, y = next(batches) if par.reads_data else (None, None)
    loss = par.step(x, y, optimizer=opt)   # forward, backward, update; the global mean loss
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import events, inflight, runtime
from ringtrain.agreement.ranks import settle
from ringtrain.errors import CheckpointError, ConfigError, rank_list
from ringtrain.parallel.clip import clip_grad_norm
from ringtrain.parallel.layout import Coords, Layout
from ringtrain.parallel.memory import StateMemory, state_memory
from ringtrain.parallel.mesh import Mesh, build_mesh
from ringtrain.parallel.order import OrderProbe, order_probe, split_order_problem
from ringtrain.parallel.pipeline import Pipeline, StageTimes
from ringtrain.parallel.shard import apply_fsdp
from ringtrain.parallel.split import StageModule, pipeline_units, split_units
from ringtrain.parallel.tensor import apply_plan, check_plan, resolve_plan

__all__ = ["Parallel", "parallelize"]

log = logging.getLogger("ringtrain.parallel")

LossFn = Callable[[Any, Any], torch.Tensor]
_MAX_DIMS = 6
_PART_LEN = 2 + _MAX_DIMS  # one tensor's ndim, dtype code, up to 6 dimensions
_HEADER_LEN = 2 * _PART_LEN  # batch header: the targets', then the inputs'
_DTYPES = (torch.int64, torch.int32, torch.float32, torch.float16, torch.bfloat16,
           torch.float64, torch.uint8, torch.bool)


def _world() -> tuple[int, int]:
    if runtime.is_initialized():
        return runtime.rank(), runtime.size()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Parallel:
    """What the training loop needs from :func:`parallelize`; see the module docstring."""

    def __init__(self, layout: Layout, coords: Coords, module: nn.Module, mesh: Mesh | None,
                 loss_fn: LossFn, pipeline: Pipeline | None, device: torch.device,
                 rank: int) -> None:
        self.layout = layout
        self.coords = coords
        #: This rank's part of the model (a stage, split and sharded as the layout says).
        self.module = module
        self.mesh = mesh
        self.loss_fn = loss_fn
        self.pipeline = pipeline
        self.device = device
        self.rank = rank
        #: The first pipelined step's batch header (targets' and inputs' shapes, dtypes).
        self._first_header: list[int] | None = None
        #: Whether the first step checked that each tensor group got one batch.
        self._batches_checked = False
        #: Whether the tensor ranks' gradients of the layers they hold whole still need
        #: comparing (see :meth:`_check_tensor_replicas`), and whether a step did already.
        self._replicas_pending = True
        self._replicas_compared = False
        #: The split layers (name -> style) whose call order the first step without a
        #: pipeline watches, for a "colwise" layer called last (see :meth:`_forward`).
        self.head_watch: dict[str, str] = {}
        #: The model's own forward on meta tensors, until a step has checked that it runs
        #: the units as the stages do (see :mod:`ringtrain.parallel.order`).
        self.order_probe: OrderProbe | None = None
        #: This rank's batch norms, until one has been said to train on split batches.
        self._batch_norms: list[tuple[str, nn.Module, str]] = []

    # -- facts --------------------------------------------------------------------------

    @property
    def is_first_stage(self) -> bool:
        return self.coords.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.stage == self.layout.pipeline - 1

    @property
    def reads_data(self) -> bool:
        """Only the first stage reads batches (the rest get activations and targets)."""
        return self.is_first_stage

    @property
    def data_rank(self) -> int:
        """This rank's shard of the global batch (pass to ``rt.data.Loader(rank=...)``)."""
        return self.coords.data

    @property
    def data_size(self) -> int:
        """Shards of the global batch (``rt.data.Loader(world_size=...)``)."""
        return self.layout.data or 1

    @property
    def stage_times(self) -> StageTimes | None:
        """Per-step schedule time and idle time of this rank's stage (None: no pipeline)."""
        return None if self.pipeline is None else self.pipeline.times

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    # -- the step -----------------------------------------------------------------------

    def step(self, inputs: Any = None, targets: Any = None,
             optimizer: torch.optim.Optimizer | None = None) -> float:
        """Forward and backward of one global batch; with ``optimizer``, also the update.

        On the first stage (every rank without a pipeline) pass this data rank's
        ``inputs`` and ``targets``; other stages pass nothing. Returns the loss of the
        global batch (mean over data ranks) on every rank.
        """
        if self._batch_norms:
            self._warn_training_batch_norm()
        # At the first step, and at the first in training mode if that one was not (a
        # dropout draws nothing in eval mode). The same on every rank: the script sets
        # the mode, and the condition counts steps.
        compare = self.layout.tensor > 1 and self._replicas_pending and (
            self.module.training or not self._replicas_compared)
        rng = _rng_digest(self.device) if compare else 0.0
        if self.layout.tensor > 1 and not self._batches_checked:
            # Once: a loader sharded by the wrong rank shows at the first batch, and the
            # check reads sums back to the host (a device sync on GPUs).
            self._check_tensor_group_batches(inputs, targets)
            self._batches_checked = True
        if self.pipeline is not None:
            targets = self._share_targets(inputs, targets)
            local = self.pipeline.run(inputs, targets)
        else:
            if inputs is None or targets is None:
                raise ConfigError(_NO_DATA)
            loss = self.loss_fn(self._forward(inputs), targets)
            loss.backward()
            local = loss.detach()
        value = self._global_loss(local, targets)
        if compare:
            self._check_tensor_replicas(rng)
            self._replicas_compared = True
            self._replicas_pending = not self.module.training
        if optimizer is not None:
            self.update(optimizer)
        return value

    def _forward(self, inputs: Any) -> Any:
        """The module's forward; at the first step, watching the split layers' calls.

        ``parallelize`` refuses a plan whose last registered layer is ``"colwise"``, but
        registration order is not call order (a model may register its output layer
        before a final norm): a ``"colwise"`` layer that the forward calls after every
        other split layer has no rowwise partner after it, so the loss would get each
        rank's slice of its output. Every rank runs the same forward, so each raises the
        same error here, after the forward's collectives and before the loss; every
        step does until one passes.
        """
        if not self.head_watch:
            return self.module(inputs)
        watched = self.head_watch
        calls: list[str] = []

        def called(name: str) -> None:
            # Before the layer runs: a misplanned pair fails inside DTensor's matmul with
            # a multi-line sharding error, so the pair is named here first.
            calls.append(name)
            problem = split_order_problem(calls, watched, complete=False)
            if problem is not None:
                raise ConfigError(problem)

        handles = [self.module.get_submodule(name).register_forward_pre_hook(
            lambda *_, name=name: called(name)) for name in watched]
        try:
            out = self.module(inputs)
        finally:
            for handle in handles:
                handle.remove()
        problem = split_order_problem(calls, watched)
        if problem is not None:
            raise ConfigError(problem)
        self.head_watch = {}  # (until a step passes, every step raises it)
        return out

    def _warn_training_batch_norm(self) -> None:
        """The batch norm warning of :func:`parallelize`, once, for a batch norm that was
        in eval() mode then and trains now."""
        message = _batch_norm_warning(self._batch_norms, _batch_splits(self.layout))
        if message is not None:
            self._batch_norms = []
            warnings.warn(message, stacklevel=3)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the gradients so that the whole model's gradient norm is at most ``max_norm``.

        ``torch.nn.utils.clip_grad_norm_`` over one process's model, for any layout:
        the norm is taken over every stage's gradients and each shard counted once
        (``clip_grad_norm_(par.parameters())`` itself sees one pipeline stage, and
        refuses tensor-parallel layers mixed with whole ones). Collective over the
        world: call it on every rank, between ``step()`` and ``update()``. Returns the
        total norm before clipping.
        """
        # Ranks that hold this stage: the element of a gradient that is not sharded
        # over all of them is on several ranks (see ringtrain.parallel.clip).
        holders = self.layout.size() // self.layout.pipeline
        world = self.layout.size() > 1
        return clip_grad_norm(self.module.parameters(), max_norm, norm_type, holders=holders,
                              device=self._comm_device() if world else None)

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` and ``zero_grad()``, metered as the step's update."""
        t0 = time.perf_counter()
        optimizer.step()
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if events.active():
            events.emit("update", t0, t1)
            events.emit("step_end", t1, t1)
        # One of the loop's stop points (ringtrain doctor --steps): nothing is in flight
        # here, and a pipeline's later stages read no batches, so the loader's check
        # never stopped them; the first stage left and the next stage's step broke.
        events.check_stop()

    def _check_tensor_group_batches(self, inputs: Any, targets: Any) -> None:
        """A ConfigError on every rank unless each tensor group got one batch.

        DTensor takes a tensor-parallel layer's input as replicated without looking:
        tensor ranks given different batches (data sharded by ``rt.rank()`` instead of
        ``par.data_rank``) silently trained on a mixture of them. One all-gather of three
        numbers per rank (sums of the inputs and targets, in float64), at the first step.
        """
        has = inputs is not None and targets is not None
        mine = torch.tensor([float(has), _batch_sum(inputs), _batch_sum(targets)],
                            dtype=torch.float64, device=self._comm_device())
        parts = [torch.zeros_like(mine) for _ in range(self.layout.size())]
        inflight.hold(mine, *parts)
        dist.all_gather(parts, mine)
        seen = [part.cpu().tolist() for part in parts]
        if self.pipeline is None:  # every rank reads data: all of them say so, together
            missing = [r for r, (present, _, _) in enumerate(seen) if not present]
            if missing:
                raise ConfigError(f"{_NO_DATA} (none on rank(s) {rank_list(missing)})")
        for r, (present, *sums) in enumerate(seen):
            c = self.layout.coords(r)
            if c.stage != 0 or c.tensor == 0 or not present:
                continue
            first = self.layout.rank_of(Coords(0, c.data, 0))
            if not _equal_to_rounding(sums, seen[first][1:]):
                raise ConfigError(
                    f"ranks {first} and {r} split the same layers (one tensor group) but got "
                    "different batches; every rank of a tensor group needs the same batch: "
                    "shard the data by par.data_rank and par.data_size (not rt.rank() and "
                    "rt.size())")

    def _check_tensor_replicas(self, rng: float) -> None:
        """A ConfigError on every rank when a tensor group's copies of a whole layer got
        different gradients.

        A layer outside the tensor plan (an embedding, a norm, the head; a rowwise
        layer's bias) is whole on each tensor rank and its gradient is never reduced
        over the tensor group: DTensor, as Megatron-LM, takes the computation outside
        the split layers to be the same on every tensor rank. It is not when the ranks
        draw different random numbers there (a dropout after a rowwise layer, the
        generators seeded per rank as DDP scripts do, ``torch.manual_seed(seed +
        rank)``; the activations between layers are plain tensors, so DTensor's RNG
        tracker never sees those ops): the copies then train apart silently. Random
        ops inside a split pair (a dropout between colwise and rowwise) may differ by
        rank, as Megatron-LM's do: the rowwise all-reduce makes everything after them
        the same, and those gradients agree. So the gradients are compared, not the
        generators, whose states (``rng``, taken before the forward) only say why.
        One all-gather of three float64 numbers per whole parameter in each tensor
        group, then the outcome over the world.
        """
        assert self.mesh is not None and self.mesh.tensor is not None
        comm_device = self._comm_device()
        # Summed where the gradients are and moved once (one device sync, not one each).
        names, sums = [], [torch.tensor([rng, 0.0, 0.0], dtype=torch.float64,
                                        device=self.device)]
        for name, param in self.module.named_parameters():
            if _split_over_tensor(param):
                continue
            names.append(name)
            grad = param.grad
            if grad is None:
                sums.append(torch.zeros(3, dtype=torch.float64, device=self.device))
                continue
            local = (grad.to_local() if hasattr(grad, "to_local") else grad).detach()
            one = torch.ones((), dtype=torch.float64, device=local.device)
            sums.append(torch.stack([one, torch.sum(local, dtype=torch.float64),
                                     torch.sum(local.abs(), dtype=torch.float64)]).to(self.device))
        mine = torch.cat(sums).to(comm_device)
        group = self.mesh.tensor.get_group()
        parts = [torch.zeros_like(mine) for _ in range(self.layout.tensor)]
        inflight.hold(mine, *parts)
        dist.all_gather(parts, mine, group=group)
        seen = [part.cpu().view(-1, 3) for part in parts]
        problem = None
        c = self.coords
        for t in range(1, self.layout.tensor):
            at = next((i for i in range(1, len(names) + 1)
                       if not _same_gradient(seen[0][i].tolist(), seen[t][i].tolist())), None)
            if at is None:
                continue
            first = self.layout.rank_of(Coords(c.stage, c.data, 0))
            other = self.layout.rank_of(Coords(c.stage, c.data, t))
            why = (_DIFFERENT_RNG if float(seen[0][0][0]) != float(seen[t][0][0])
                   else _DIFFERENT_FORWARD)
            problem = (
                f"ranks {first} and {other} (one tensor group) each hold all of "
                f"{names[at - 1]} (it is not split over the tensor group) but computed "
                "different gradients for it at the first step, so its copies would train "
                f"apart silently: {why}")
            break
        failed = settle(problem, lambda p: inflight.gather_objects(
            p, device=comm_device if comm_device.type == "cuda" else None))
        if failed:
            raise ConfigError(failed[min(failed)])

    def _share_targets(self, inputs: Any, targets: Any) -> Any:
        """Send the batch's shape and targets from stage 0 to the other stages.

        Every stage checks the same header, so a batch that does not split into the
        micro-batches is the same error on all of them (no stage waits forever).
        """
        assert self.mesh is not None and self.mesh.pipeline is not None
        group = self.mesh.pipeline_group()
        src = self.layout.rank_of(Coords(0, self.coords.data, self.coords.tensor))
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        if self.is_first_stage:
            if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
                header[0] = -1
            elif (targets.dim() > _MAX_DIMS or targets.dtype not in _DTYPES
                  or inputs.dim() > _MAX_DIMS or inputs.dim() == 0
                  or inputs.shape[0] != targets.shape[0]):
                header[0] = -2
            else:
                for at, t in ((0, targets), (_PART_LEN, inputs)):
                    header[at] = t.dim()
                    header[at + 1] = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
                    header[at + 2:at + 2 + t.dim()] = torch.tensor(t.shape)
        comm_device = self._comm_device()
        header = header.to(comm_device)
        inflight.hold(header)
        dist.broadcast(header, src=src, group=group)
        h = header.cpu().tolist()
        if h[0] == -1:
            raise ConfigError("the first pipeline stage must pass step(inputs, targets) tensors "
                              "(the stages after it pass nothing)")
        if h[0] == -2:
            raise ConfigError("step(inputs, targets): inputs and targets must be tensors with "
                              "the same first (batch) dimension and at most 6 dimensions")
        shape = h[2:2 + h[0]]
        self.layout.check_batch(int(shape[0]) if shape else 0)
        self._check_same_shapes(h)
        self._check_unit_order(h)
        if self.is_first_stage:
            buf = targets.to(comm_device).contiguous()
        else:
            buf = torch.empty(shape, dtype=_DTYPES[h[1]], device=comm_device)
        inflight.hold(buf)
        dist.broadcast(buf, src=src, group=group)
        return buf.to(self.device) if self.is_last_stage else None

    def _check_unit_order(self, header: list[int]) -> None:
        """A ConfigError on every stage when the model's forward is not its units in order.

        Every stage knows the inputs' shape and dtype from the header and holds the same
        probe, so all of them find the same answer, before the targets are sent.
        """
        probe, inputs = self.order_probe, header[_PART_LEN:]
        if probe is None or inputs[1] < 0:
            return
        shape = [int(n) for n in inputs[2:2 + inputs[0]]]
        shape[0] //= self.layout.m  # what stage 0 gets: one micro-batch
        probe.check(shape, _DTYPES[inputs[1]], self.layout.pipeline)
        self.order_probe = None  # checked once; a failed check stays and fails every step

    def _check_same_shapes(self, header: list[int]) -> None:
        """A ConfigError on every stage when this batch's shapes differ from the first's.

        torch's pipeline stages size their activation buffers at the first step; a later
        batch of another shape (a shorter sequence, a smaller last batch) made the next
        stage receive into the old buffers and fail inside torch, or compute on stale
        values, while its neighbour saw only a closed connection.
        """
        if self._first_header is None:
            self._first_header = header
            return
        if header == self._first_header:
            return

        def shapes(h: list[int]) -> str:
            def one(part: list[int]) -> str:
                dtype = str(_DTYPES[part[1]]).removeprefix("torch.") if part[1] >= 0 else "?"
                return f"{part[2:2 + part[0]]} {dtype}"
            return f"inputs {one(h[_PART_LEN:])}, targets {one(h[:_PART_LEN])}"

        raise ConfigError(
            f"a pipelined step got {shapes(header)} but the pipeline was built for the first "
            f"step's {shapes(self._first_header)}; torch's pipeline stages keep the first "
            "step's activation shapes, so give every step the same shapes and dtypes (pad "
            "sequences to one length, use drop_last=True or the loader's padding)")

    def _comm_device(self) -> torch.device:
        """Where this library's own small collectives run: NCCL needs CUDA tensors."""
        nccl = dist.get_backend() == "nccl"
        return self.device if nccl else torch.device("cpu")

    def _global_loss(self, local: torch.Tensor | None, targets: Any) -> float:
        """The global batch's mean loss; a ConfigError if the data ranks' batch sizes differ.

        FSDP2 averages the data ranks' gradients and this averages their mean losses:
        the global batch's mean only when every data rank's batch has as many samples.
        A rank with a shorter batch would be weighed more than its share, silently, so
        the same all-reduce carries each data rank's sample count and every rank checks
        them. (Sequence lengths may differ between data ranks, as under FSDP2 and DDP:
        each rank's per-token mean then counts equally.)
        """
        if self.layout.size() == 1:
            return float(local) if local is not None else float("nan")
        d = self.data_size
        # Each (data rank) loss and size counted once: by the last stage's first tensor
        # rank, which has the targets in every layout.
        owner = self.is_last_stage and self.coords.tensor == 0 and local is not None
        comm_device = self._comm_device()
        value = torch.zeros(1 + d, dtype=torch.float64)  # the loss, then each data rank's samples
        if owner:
            assert local is not None
            value[0] = float(local)
            value[1 + self.data_rank] = _samples(targets)
        value = value.to(comm_device)
        inflight.hold(value)
        dist.all_reduce(value)
        totals = value.cpu().tolist()
        sizes = [int(n) for n in totals[1:]]
        if any(n != sizes[0] for n in sizes):
            listed = ", ".join(f"data rank {r}: {n} samples" for r, n in enumerate(sizes))
            raise ConfigError(
                f"the data ranks' batches differ in size ({listed}); the step averages the "
                "ranks' mean losses and gradients, which is the global batch's mean only "
                "when every data rank has the same batch size: use the loader's padding or "
                "drop_last=True (this step's gradients are kept: call optimizer.zero_grad() "
                "before the next step)")
        return totals[0] / d

    # -- state --------------------------------------------------------------------------

    def state_memory(self, optimizer: torch.optim.Optimizer | None = None) -> StateMemory:
        """Measured bytes of parameters, gradients and optimizer state on this rank."""
        return state_memory(self.module.parameters(), optimizer)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model, unsharded, on every rank (CPU tensors).

        Collective over the world; meant for tests and small models.
        """
        local: dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            local[name] = full.detach().cpu().clone()
        if self.layout.size() == 1:
            return local
        parts: list[Any] = inflight.gather_objects(local, device=self._comm_device())
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for name, tensor in part.items():
                merged.setdefault(name, tensor)
        return merged

    def state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Model (and optimizer) state keyed by the full model's names, as DCP saves it.

        An optimizer that never stepped keeps its empty state (see :meth:`_state`).
        """
        return self._state(optimizer)[0]

    def _state(self, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], bool]:
        """:meth:`state_dict`, and whether its optimizer state was made up (never stepped)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        if optimizer is None:
            return {"model": get_model_state_dict(self.module, options=options)}, False
        fresh = not optimizer.state and all(
            q.grad is None for group in optimizer.param_groups for q in group["params"])
        model_sd, optim_sd = get_state_dict(self.module, optimizer, options=options)
        made_up = fresh and bool(optimizer.state)
        if made_up:
            # get_state_dict creates the state of an optimizer that never stepped by one
            # step() with zero gradients at lr 0 (torch's _init_optim_state): it counts a
            # step (Adam's bias correction then takes the first real update for the
            # second) and, with L2 weight decay, fills momentum buffers. Handing the
            # optimizer its empty state back keeps a run that asked for its state (a
            # save at step 0, load()'s template) the run that did not.
            optimizer.state.clear()
        return {"model": model_sd, "optimizer": optim_sd}, made_up

    def load_state_dict(self, state: Mapping[str, Any],
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        if optimizer is None:
            set_model_state_dict(self.module, state["model"], options=options)
        else:
            set_state_dict(self.module, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=options)

    def save(self, path: str, optimizer: torch.optim.Optimizer | None = None,
             extra: Mapping[str, Any] | None = None) -> Any:
        """Save this layout's state to ``path`` with ``rt.checkpoint.save_sharded``."""
        from ringtrain import checkpoint

        state, made_up = self._state(optimizer)
        if made_up:
            # The optimizer never stepped: its entries are the state get_state_dict made
            # up (see _state), which a resumed run must not use (it counts a step; ASGD's
            # eta and Rprop's step sizes are made at lr 0). They are saved, so that
            # the checkpoint has every entry a load at any layout asks for, with this
            # mark, which tells load() to hand the optimizer its empty state back.
            state[_UNSTEPPED] = True
        if extra:
            state.update(extra)
        return checkpoint.save_sharded(path, state)

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None,
             extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint saved at any layout into this one; returns the state."""
        from torch.distributed.checkpoint.api import CheckpointException

        from ringtrain import checkpoint

        state = self.state_dict(optimizer)
        if extra:
            state.update(extra)
        try:
            checkpoint.load_sharded(path, state)
        except CheckpointException as exc:
            # DCP gathers every rank's failure and raises the same exception on all of
            # them: a BaseException (not caught by `except Exception`) whose text is a
            # traceback per rank. The cause is a user's mismatch, so say it in one line.
            raise CheckpointError(_load_problem(path, exc, optimizer is not None)) from None
        self.load_state_dict(state, optimizer)
        if optimizer is not None and _saved_unstepped(path):
            optimizer.state.clear()  # saved before its first update: fresh, as it was then
        return state

    def __repr__(self) -> str:
        c = self.coords
        return (f"Parallel({self.layout.describe()}; rank {self.rank} = stage {c.stage}, "
                f"data {c.data}, tensor {c.tensor})")


#: Top-level checkpoint entry of an optimizer saved before its first update (see save()).
_UNSTEPPED = "optimizer_unstepped"


def _saved_unstepped(path: str) -> bool:
    """Whether the checkpoint at ``path`` holds an optimizer saved before it stepped.

    Read from DCP's metadata (its list of entries), so that checkpoints without the
    entry load as before; every rank reads the same directory, so all agree.
    """
    import torch.distributed.checkpoint as dcp

    from ringtrain import checkpoint

    try:
        directory = checkpoint._resolve_sharded(Path(path))
        entries = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - the load itself read it: only a race lands here
        return False
    return _UNSTEPPED in entries


def _load_problem(path: str, exc: BaseException, with_optimizer: bool) -> str:
    """One line saying why DCP could not load ``path`` into this layout's state."""
    failures = getattr(exc, "failures", None) or {}
    causes = [pair[0] for pair in failures.values() if isinstance(pair, tuple) and pair]
    cause = str(causes[0]).strip().splitlines()[0] if causes else type(exc).__name__
    hint = ("the checkpoint was saved from another model (other names or shapes); load it "
            "into the model that saved it")
    if with_optimizer and "optimizer." in cause:
        hint = ("the checkpoint may hold no optimizer state (saved as par.save(path)); "
                "load it with par.load(path) and no optimizer")
    return f"cannot load checkpoint {path} into this model: {cause} ({hint})"


def _check(model: nn.Module, layout: Layout, split: str | Sequence[str],
           tensor_plan: Mapping[str, str] | None) -> tuple[dict[str, str], Any, bool]:
    """Everything that can be wrong with this model under this layout (pure), the
    pipeline's unit groups, and whether a training batch norm was warned about."""
    _check_not_compiled_wrapper(model, layout, tensor_plan)
    resolved: dict[str, str] = {}
    if layout.tensor > 1:
        if not tensor_plan:
            raise ConfigError(
                f"tensor={layout.tensor} needs tensor_plan= (module name patterns -> "
                "'colwise' / 'rowwise'), e.g. {'blocks.*.mlp.fc': 'colwise', "
                "'blocks.*.mlp.proj': 'rowwise'}")
        resolved = resolve_plan(model, tensor_plan)
        check_plan(model, resolved, layout.tensor)
    elif tensor_plan is not None:
        # A plan describes the model, so a script may pass it at any degree (the example
        # does); with tensor=1 it splits nothing, but a wrong one (a pattern matching no
        # module, a layer that is not linear) must not wait for tensor > 1 to show.
        check_plan(model, resolve_plan(model, tensor_plan), 1)
    said = _check_batch_norm(model, layout)
    groups = split_units(model, layout.pipeline, split) if layout.pipeline > 1 else None
    return resolved, groups, said


def _check_not_compiled_wrapper(model: nn.Module, layout: Layout,
                                tensor_plan: Mapping[str, str] | None) -> None:
    """A ``torch.compile(model)`` wrapper where the layout needs the model's layers.

    The wrapper holds the model as its one child ``_orig_mod``: a pipeline found one
    unit to place ("only 1 unit(s) (_orig_mod)"), or, the model being a Sequential, cut
    its layers out of the wrapper and ran them uncompiled without a word; a tensor
    plan's patterns matched nothing. Sharding alone trains it compiled (FSDP2 shards
    the wrapper as one unit), so only these layouts are refused.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing compiled
    if eval_frame is None or not isinstance(model, eval_frame.OptimizedModule):
        return
    if layout.pipeline > 1 or tensor_plan is not None:
        needs = "pipeline stages need" if layout.pipeline > 1 else "a tensor plan needs"
        raise ConfigError(
            f"the model is a torch.compile() wrapper, and {needs} its layers, which it "
            "holds under '_orig_mod.' as one compiled graph: pass the model itself and compile "
            "in place, its blocks before parallelize() (block.compile() for each, as "
            "torchtitan does) or this rank's part after it (par.module.compile())")


def _batch_splits(layout: Layout) -> str:
    """How ``layout`` splits the batch a BatchNorm sees (``""``: it does not)."""
    parts = [f"data {layout.data}"] if (layout.data or 1) > 1 else []
    if layout.pipeline > 1 and layout.m > 1:
        parts.append(f"{layout.m} micro-batches")
    return " and ".join(parts)


def _batch_norms(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Each batch norm's name, module and class name (taken before FSDP2, which renames
    the class of a module it shards: BatchNorm1d becomes FSDPBatchNorm1d)."""
    return [(name, module, type(module).__name__) for name, module in model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)]


def _batch_norm_warning(norms: Sequence[tuple[str, nn.Module, str]], splits: str) -> str | None:
    """What to say about the first training-mode batch norm when the layout splits the
    batch (``splits``), or None.

    Batch norm normalises by the statistics of the batch it sees: each data rank's
    shard and each pipeline micro-batch, not the global batch, as under FSDP2 and DDP
    (where ResNets train this way), so the outputs and gradients differ from one
    process's, and the running statistics differ between data replicas (FSDP2 does not
    reconcile buffers; DDP broadcasts rank 0's). Said once, not refused: it is how
    these models train data-parallel.
    """
    if not splits:
        return None
    for name, module, kind in norms:
        if module.training:
            return (
                f"{name or 'the model'} is a {kind} in training mode and this "
                f"layout ({splits}) normalises each rank's shard or micro-batch "
                "by its own statistics, as FSDP2 and DDP do: the running statistics differ "
                "between data replicas (each checkpoint keeps one replica's); use LayerNorm or "
                "GroupNorm, or torch.nn.SyncBatchNorm (on GPUs) for the global batch's statistics")
    return None


def _check_batch_norm(model: nn.Module, layout: Layout) -> bool:
    """Warn about a training-mode batch norm under a layout that splits the batch;
    whether it was said (see :func:`_batch_norm_warning`)."""
    message = _batch_norm_warning(_batch_norms(model), _batch_splits(layout))
    if message is not None:
        warnings.warn(message, stacklevel=3)
    return message is not None


def _check_unpipelined(layout: Layout, split: str | Sequence[str] | None,
                       schedule: str | None) -> None:
    """A ConfigError for a pipeline setting given without a pipeline, which would do nothing."""
    if layout.pipeline > 1:
        return
    if schedule is not None and schedule != "1f1b":
        # (Layout normalised it; the default, "1f1b", is what leaving it out means.)
        raise ConfigError(
            f"schedule={schedule!r} has no effect with pipeline=1 (there are no stages to "
            "schedule); drop schedule= or raise pipeline")
    if split is None or (isinstance(split, str) and split == "params"):
        return
    if isinstance(split, str) or list(split):
        raise ConfigError(
            f"split={split!r} has no effect with pipeline=1 (there is one stage, nothing to "
            "cut); drop split= or raise pipeline")


_NO_DATA = ("step() needs inputs and targets on every rank when there is no pipeline "
            "(every rank reads its data shard)")


_DIFFERENT_RNG = (
    "their random number generators differ (seeded per rank, as torch.manual_seed(seed + "
    "rank)?), so a dropout or other random op outside the split layers drew different "
    "numbers on each; seed every rank of a tensor group the same, e.g. "
    "torch.manual_seed(seed + par.data_rank) after parallelize()")
_DIFFERENT_FORWARD = (
    "the forward computes differently on them outside the split layers (a random op on a "
    "generator of its own, or code that depends on the rank); make it the same on every "
    "rank of a tensor group")


def _rng_digest(device: torch.device) -> float:
    """A checksum of the random generators a forward on ``device`` draws from (the CPU's,
    and the current CUDA device's on CUDA): equal on ranks seeded alike."""
    crc = zlib.crc32(torch.get_rng_state().numpy().tobytes())
    if device.type == "cuda":
        crc = zlib.crc32(torch.cuda.get_rng_state(device).numpy().tobytes(), crc)
    return float(crc)  # (32 bits: exact in the float64 it travels in)


def _split_over_tensor(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the tensor group (each tensor rank holds a part),
    rather than whole on each: a DTensor sharded along the mesh's ``tensor`` dimension.
    (FSDP2's data shards alone are the same part on every tensor rank.)"""
    placements = getattr(param, "placements", None)
    if placements is None:
        return False
    names = param.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
    return any(name == "tensor" and not placement.is_replicate()
               for name, placement in zip(names, placements, strict=False))


def _same_gradient(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two (present, sum, sum of magnitudes) digests of a gradient agree.

    The same computation on two ranks gives the same gradient, up to the rounding of
    an order that may differ (atomics on GPUs, low precision): a thousandth of the
    gradient's magnitude. Different dropout masks differ by the whole of it.
    """
    if a[0] != b[0]:
        return False
    scale = max(abs(a[2]), abs(b[2]))
    return abs(a[1] - b[1]) <= 1e-3 * scale and abs(a[2] - b[2]) <= 1e-3 * scale


def _samples(targets: Any) -> float:
    """The samples of a targets tensor (its first dimension); -1 for anything else."""
    if not isinstance(targets, torch.Tensor):
        return -1.0
    return float(targets.shape[0] if targets.dim() else 1)


def _batch_sum(batch: Any) -> float:
    """The float64 sum of a tensor batch (0 for anything else): a cheap fingerprint."""
    if not isinstance(batch, torch.Tensor) or batch.is_meta:
        return 0.0
    return float(torch.sum(batch.detach(), dtype=torch.float64))


def _fingerprint(model: nn.Module) -> list[float]:
    """The float64 sum of every parameter and buffer of ``model``, in order (no copies)."""
    sums: list[float] = []
    for t in (*model.parameters(), *model.buffers()):
        if t.is_meta or t.numel() == 0:
            sums.append(float(t.numel()))
        elif t.is_floating_point():
            sums.append(float(torch.sum(t.detach(), dtype=torch.float64)))
        else:
            sums.append(float(t.detach().sum()))
    return sums


def _equal_to_rounding(a: Sequence[float], b: Sequence[float]) -> bool:
    # Sums of the same values agree to rounding (a rank's thread count can change the
    # reduction's order); two random initialisations differ far beyond it.
    return len(a) == len(b) and all(
        abs(x - y) <= 1e-6 * max(1.0, abs(x), abs(y)) for x, y in zip(a, b, strict=True))


_DIFFERENT_MODEL = (
    "the model passed to parallelize() differs from rank 0's (its shapes or initial "
    "values): replicas would train apart. Build it the same way on every rank, after "
    "the same torch.manual_seed(...)")


def _agree(problem: str | None, rank: int, world: int,
           fingerprint: Sequence[float] = (), device: torch.device | None = None) -> None:
    """Raise the same ConfigError on every rank if the checks failed on any.

    The checks are pure, so normally every rank finds the same problem; gathering the
    outcomes first also covers ranks that disagree (different models), and makes sure
    no rank leaves while another is still joining the process group (a peer that
    exits mid-rendezvous breaks Gloo's connection set-up on the others). The same
    gather compares the ranks' models (``fingerprint``): FSDP2 and DTensor do not
    broadcast initial values, so a model built with another seed on one rank would
    make data and tensor replicas that silently never agree. ``device``: this rank's
    (see :func:`_resolve_device`), where the gather runs under NCCL.
    """
    def gather(mine: str | None) -> list[str | None]:
        if world == 1:
            return [mine]
        # NCCL moves only CUDA tensors, on this rank's own device.
        nccl = dist.get_backend() == "nccl"
        where = None
        if nccl:
            where = (device if device is not None and device.type == "cuda"
                     else torch.device("cuda", torch.cuda.current_device()))
        outcomes = inflight.gather_objects((mine, list(fingerprint)), device=where)
        first = outcomes[0][1]
        return [found if found or _equal_to_rounding(prints, first) else _DIFFERENT_MODEL
                for found, prints in outcomes]

    failed = settle(problem, gather)
    if not failed:
        return
    first = failed[min(failed)]
    where = "" if len(failed) == world else f" (on rank(s) {rank_list(failed)})"
    raise ConfigError(f"{first}{where}")


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """This rank's device (``device``, default ``rt.device()``), with its index, made
    CUDA's current device.

    FSDP2 puts the shards on the *current* CUDA device (``torch.cuda.current_device()``
    of the mesh's device type, whatever the module was moved to), and DeviceMesh and
    NCCL bind this rank's communicators to it ("manual device selection should happen
    BEFORE the DeviceMesh initialization", torch's DeviceMesh doc). ``device="cuda:1"``
    on a process whose current device was still 0 sharded the stage onto cuda:0 and
    gathered the checks there, on the same GPU as rank 0's. Before ``rt.init()`` (a
    torchrun script with its own process group) and before anything touched CUDA, the
    default is ``cuda:$LOCAL_RANK``, as DeviceMesh would pick, not device 0 on every rank.
    """
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"parallelize(device={device!r}): {exc}") from None
    else:
        dev = runtime.device()  # before rt.init(): the script's choice, else cuda:$LOCAL_RANK
    if dev.type != "cuda":
        return dev
    if dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ConfigError(f"parallelize: device {dev} does not exist here "
                          f"({torch.cuda.device_count()} CUDA device(s))")
    torch.cuda.set_device(dev)
    return dev


def parallelize(model: nn.Module, loss_fn: LossFn, *, pipeline: int = 1, tensor: int = 1,
                data: int | None = None, shard: bool | None = None,
                microbatches: int | None = None,
                schedule: str | None = None, split: str | Sequence[str] | None = None,
                tensor_plan: Mapping[str, str] | None = None,
                device: torch.device | str | None = None) -> Parallel:
    """Lay the world out as ``pipeline x data x tensor`` and apply each technique.

    Args:
        model: the whole model, built the same way (same seed) on every rank. It is
            taken over: units of other stages are dropped to free their memory, the
            rest are split and sharded in place. Use ``Parallel.module`` afterwards.
        loss_fn: ``loss_fn(output, target)``, a mean over its samples.
        pipeline, tensor, data, microbatches: see :class:`Layout`.
        schedule: ``"1f1b"`` (the default) or ``"gpipe"``; another schedule than the
            default with ``pipeline=1`` is a ConfigError (it would do nothing).
        shard: shard the state over the data ranks (``None``, the default: yes);
            ``True`` with a single data replica warns that it has no effect.
        split: how to cut stages: ``"params"`` (the default: even parameter count) or
            the names of the units that start stages 1, 2, ... (e.g. ``["blocks.3"]``);
            split points with ``pipeline=1`` are a ConfigError.
        tensor_plan: module-name patterns -> ``"colwise"`` / ``"rowwise"`` /
            ``"colwise_gathered"``
            (see :mod:`ringtrain.parallel.tensor`); needed when ``tensor > 1``. With
            ``tensor=1`` it splits nothing but is still checked against the model.
        device: default ``rt.device()``; a CUDA device becomes the current one (FSDP2
            and DeviceMesh place shards and communicators there), see :func:`_resolve_device`.
    """
    rank, world = _world()
    problem: str | None = None
    dev: torch.device | None = None
    try:
        # Before any collective: the checks' own gather runs on this device under NCCL.
        dev = _resolve_device(device)
        layout = Layout(pipeline, tensor, data, shard is not False, microbatches,
                        "1f1b" if schedule is None else schedule).resolve(world)
        _check_unpipelined(layout, split, layout.schedule if schedule is not None else None)
        resolved, groups, norm_said = _check(model, layout,
                                             "params" if split is None else split, tensor_plan)
    except ConfigError as exc:
        problem = str(exc)
    _agree(problem, rank, world, _fingerprint(model) if world > 1 else (), dev)
    assert dev is not None  # (resolved, or its ConfigError raised on every rank above)
    if shard is True and layout.data == 1 and world > 1:
        warnings.warn(f"shard=True has no effect: {layout.describe()} has one data replica, "
                      "so there is nothing to shard over", stacklevel=2)
    coords = layout.coords(rank)
    mesh = build_mesh(layout, dev.type) if world > 1 else None

    probe = None
    if groups is not None:
        # Before the cut: the probe copies the model's structure (as meta tensors).
        probe = order_probe(model, [name for group in groups for name, _ in group], resolved)
        mine = groups[coords.stage]
        for stage, others in enumerate(groups):
            if stage != coords.stage:
                for _, unit in others:
                    unit.to("meta")  # free other stages' memory; they live elsewhere
        module: nn.Module = StageModule(mine)
        units = [m for _, m in mine]
    else:
        module = model
        units = [m for _, m in pipeline_units(model)]
    module.to(dev)
    norms = _batch_norms(module) if not norm_said and _batch_splits(layout) else []
    local_names = {name for name, _ in module.named_modules()}
    local_plan = {n: style for n, style in resolved.items() if n in local_names}
    if local_plan:  # (a stage may hold no planned layer, e.g. only the embedding)
        assert mesh is not None and mesh.tensor is not None
        apply_plan(module, local_plan, mesh.tensor)
    if layout.data and layout.data > 1:
        assert mesh is not None
        # In a pipeline every micro-batch runs forward and backward separately; keeping
        # the stage's parameters gathered for the step avoids a gather per micro-batch
        # (torchtitan's default for the same reason).
        apply_fsdp(module, units, mesh.data, reshard_after_forward=layout.pipeline == 1)
    pipe = None
    if layout.pipeline > 1:
        assert mesh is not None
        pipe = Pipeline(module, coords.stage, layout.pipeline, layout.m, layout.schedule,
                        loss_fn, dev, mesh.pipeline_group())
    par = Parallel(layout, coords, module, mesh, loss_fn, pipe, dev, rank)
    par.order_probe = probe
    if pipe is None and layout.tensor > 1:
        par.head_watch = dict(local_plan)
    # A batch norm in eval() mode now and switched to train() later (a script that
    # evaluates first, or builds the model in eval mode) is said at that step.
    par._batch_norms = norms
    log.info("%r", par)
    return par
