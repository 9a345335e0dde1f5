"""Model parallelism: sharded data parallel, pipeline and tensor parallel, on one mesh.

ringtrain composes PyTorch's own engines and does not re-implement them: FSDP2
(``torch.distributed.fsdp.fully_shard``) shards parameters, gradients and optimizer
state over the data ranks; DTensor (``torch.distributed.tensor.parallel``) splits
linear and attention layers over the tensor ranks; ``torch.distributed.pipelining``
runs stages with GPipe or 1F1B micro-batch schedules. One module per concern:

- :mod:`~ringtrain.parallel.layout`   degrees, rank coordinates, checks (pure)
- :mod:`~ringtrain.parallel.mesh`     the ``DeviceMesh`` of a layout
- :mod:`~ringtrain.parallel.split`    pipeline units and the cut into stages
- :mod:`~ringtrain.parallel.order`    the check that forward runs the units as the stages do
- :mod:`~ringtrain.parallel.tensor`   tensor-parallel plans (column / row splits)
- :mod:`~ringtrain.parallel.shard`    FSDP2, with its gathers and scatters timed
- :mod:`~ringtrain.parallel.pipeline` the stage and its schedule, with the bubble timed
- :mod:`~ringtrain.parallel.memory`   measured bytes of training state per rank
- :mod:`~ringtrain.parallel.clip`     gradient clipping by the whole model's norm
- :mod:`~ringtrain.parallel.engine`   :func:`parallelize` and :class:`Parallel`

Example (docs/parallel.md has more)::

    import ringtrain as rt
    from ringtrain.parallel import parallelize

    rt.init()
    par = parallelize(model, loss_fn, pipeline=2, tensor=2, shard=True,
                      tensor_plan={"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"})
    opt = torch.optim.AdamW(par.parameters(), lr=3e-4)
    loss = par.step(x, y, optimizer=opt)     # x, y on the first stage; None elsewhere
"""

from __future__ import annotations

from ringtrain.parallel.engine import Parallel, parallelize
from ringtrain.parallel.layout import SCHEDULES, Coords, Layout
from ringtrain.parallel.memory import StateMemory, state_memory
from ringtrain.parallel.pipeline import BUBBLE_EVENT, StageTimes
from ringtrain.parallel.shard import SHARD_EVENT
from ringtrain.parallel.split import StageModule, pipeline_units, split_by_params

__all__ = [
    "BUBBLE_EVENT",
    "SCHEDULES",
    "SHARD_EVENT",
    "Coords",
    "Layout",
    "Parallel",
    "StageModule",
    "StageTimes",
    "StateMemory",
    "parallelize",
    "pipeline_units",
    "split_by_params",
    "state_memory",
]
