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
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import events, inflight, runtime
from ringtrain.agreement.ranks import settle
from ringtrain.errors import ConfigError, rank_list
from ringtrain.parallel.layout import Coords, Layout
from ringtrain.parallel.memory import StateMemory, state_memory
from ringtrain.parallel.mesh import Mesh, build_mesh
from ringtrain.parallel.pipeline import Pipeline, StageTimes
from ringtrain.parallel.shard import apply_fsdp
from ringtrain.parallel.split import StageModule, pipeline_units, split_units
from ringtrain.parallel.tensor import apply_plan, check_plan, resolve_plan

__all__ = ["Parallel", "parallelize"]

log = logging.getLogger("ringtrain.parallel")

LossFn = Callable[[Any, Any], torch.Tensor]
_HEADER_LEN = 8  # batch header: ndim, dtype code, up to 6 dimensions
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
        if self.pipeline is not None:
            targets = self._share_targets(inputs, targets)
            local = self.pipeline.run(inputs, targets)
        else:
            if inputs is None or targets is None:
                raise ConfigError("step() needs inputs and targets on every rank when there "
                                  "is no pipeline (every rank reads its data shard)")
            loss = self.loss_fn(self.module(inputs), targets)
            loss.backward()
            local = loss.detach()
        value = self._global_loss(local)
        if optimizer is not None:
            self.update(optimizer)
        return value

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` and ``zero_grad()``, metered as the step's update."""
        t0 = time.perf_counter()
        optimizer.step()
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if events.active():
            events.emit("update", t0, t1)
            events.emit("step_end", t1, t1)

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
            elif (targets.dim() > _HEADER_LEN - 2 or targets.dtype not in _DTYPES
                  or inputs.shape[0] != targets.shape[0]):
                header[0] = -2
            else:
                header[0], header[1] = targets.dim(), _DTYPES.index(targets.dtype)
                header[2:2 + targets.dim()] = torch.tensor(targets.shape)
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
        if self.is_first_stage:
            buf = targets.to(comm_device).contiguous()
        else:
            buf = torch.empty(shape, dtype=_DTYPES[h[1]], device=comm_device)
        inflight.hold(buf)
        dist.broadcast(buf, src=src, group=group)
        return buf.to(self.device) if self.is_last_stage else None

    def _comm_device(self) -> torch.device:
        """Where this library's own small collectives run: NCCL needs CUDA tensors."""
        nccl = dist.get_backend() == "nccl"
        return self.device if nccl else torch.device("cpu")

    def _global_loss(self, local: torch.Tensor | None) -> float:
        if self.layout.size() == 1:
            return float(local) if local is not None else float("nan")
        # Each (data rank) loss counted once: by the last stage's first tensor rank.
        owner = self.is_last_stage and self.coords.tensor == 0 and local is not None
        comm_device = self._comm_device()
        value = torch.zeros((), dtype=torch.float64, device=comm_device)
        if owner:
            assert local is not None
            value += local.to(comm_device, torch.float64)
        inflight.hold(value)
        dist.all_reduce(value)
        return float(value) / self.data_size

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
        """Model (and optimizer) state keyed by the full model's names, as DCP saves it."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_state_dict,
        )

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        if optimizer is None:
            return {"model": get_model_state_dict(self.module, options=options)}
        model_sd, optim_sd = get_state_dict(self.module, optimizer, options=options)
        return {"model": model_sd, "optimizer": optim_sd}

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

        state = self.state_dict(optimizer)
        if extra:
            state.update(extra)
        return checkpoint.save_sharded(path, state)

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None,
             extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint saved at any layout into this one; returns the state."""
        from ringtrain import checkpoint

        state = self.state_dict(optimizer)
        if extra:
            state.update(extra)
        checkpoint.load_sharded(path, state)
        self.load_state_dict(state, optimizer)
        return state

    def __repr__(self) -> str:
        c = self.coords
        return (f"Parallel({self.layout.describe()}; rank {self.rank} = stage {c.stage}, "
                f"data {c.data}, tensor {c.tensor})")


def _check(model: nn.Module, layout: Layout, split: str | Sequence[str],
           tensor_plan: Mapping[str, str] | None) -> tuple[dict[str, str], Any]:
    """Everything that can be wrong with this model under this layout (pure)."""
    resolved: dict[str, str] = {}
    if layout.tensor > 1:
        if not tensor_plan:
            raise ConfigError(
                f"tensor={layout.tensor} needs tensor_plan= (module name patterns -> "
                "'colwise' / 'rowwise'), e.g. {'blocks.*.mlp.fc': 'colwise', "
                "'blocks.*.mlp.proj': 'rowwise'}")
        resolved = resolve_plan(model, tensor_plan)
        check_plan(model, resolved, layout.tensor)
    groups = split_units(model, layout.pipeline, split) if layout.pipeline > 1 else None
    return resolved, groups


def _agree(problem: str | None, rank: int, world: int) -> None:
    """Raise the same ConfigError on every rank if the checks failed on any.

    The checks are pure, so normally every rank finds the same problem; gathering the
    outcomes first also covers ranks that disagree (different models), and makes sure
    no rank leaves while another is still joining the process group (a peer that
    exits mid-rendezvous breaks Gloo's connection set-up on the others).
    """
    def gather(mine: str | None) -> list[str | None]:
        if world == 1:
            return [mine]
        # NCCL moves only CUDA tensors (the device is not known yet: this rank's own).
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        return inflight.gather_objects(mine, device=device)

    failed = settle(problem, gather)
    if not failed:
        return
    first = failed[min(failed)]
    where = "" if len(failed) == world else f" (on rank(s) {rank_list(failed)})"
    raise ConfigError(f"{first}{where}")


def parallelize(model: nn.Module, loss_fn: LossFn, *, pipeline: int = 1, tensor: int = 1,
                data: int | None = None, shard: bool | None = None,
                microbatches: int | None = None,
                schedule: str = "1f1b", split: str | Sequence[str] = "params",
                tensor_plan: Mapping[str, str] | None = None,
                device: torch.device | str | None = None) -> Parallel:
    """Lay the world out as ``pipeline x data x tensor`` and apply each technique.

    Args:
        model: the whole model, built the same way (same seed) on every rank. It is
            taken over: units of other stages are dropped to free their memory, the
            rest are split and sharded in place. Use ``Parallel.module`` afterwards.
        loss_fn: ``loss_fn(output, target)``, a mean over its samples.
        pipeline, tensor, data, microbatches, schedule: see :class:`Layout`.
        shard: shard the state over the data ranks (``None``, the default: yes);
            ``True`` with a single data replica warns that it has no effect.
        split: how to cut stages: ``"params"`` (even parameter count) or the names of
            the units that start stages 1, 2, ... (e.g. ``["blocks.3"]``).
        tensor_plan: module-name patterns -> ``"colwise"`` / ``"rowwise"``
            (see :mod:`ringtrain.parallel.tensor`); needed when ``tensor > 1``.
        device: default ``rt.device()``.
    """
    rank, world = _world()
    problem: str | None = None
    try:
        layout = Layout(pipeline, tensor, data, shard is not False, microbatches,
                        schedule).resolve(world)
        resolved, groups = _check(model, layout, split, tensor_plan)
    except ConfigError as exc:
        problem = str(exc)
    _agree(problem, rank, world)
    if shard is True and layout.data == 1 and world > 1:
        warnings.warn(f"shard=True has no effect: {layout.describe()} has one data replica, "
                      "so there is nothing to shard over", stacklevel=2)
    dev = torch.device(device) if device is not None else runtime.device()
    coords = layout.coords(rank)
    mesh = build_mesh(layout, dev.type) if world > 1 else None

    if groups is not None:
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
    log.info("%r", par)
    return par
