"""The mesh's dimensions for a layout, and the timed FSDP collectives (no processes)."""

from __future__ import annotations

import pytest

from ringtrain.parallel.layout import Layout
from ringtrain.parallel.mesh import mesh_dims
from ringtrain.parallel.shard import timed_comms


@pytest.mark.parametrize(("layout", "world", "dims"), [
    (Layout(), 1, []),
    (Layout(shard=True), 4, [("data", 4)]),
    (Layout(shard=False), 4, [("replicate", 4), ("data", 1)]),  # FSDP2's hybrid mode
    (Layout(pipeline=2, tensor=2), 8, [("pipeline", 2), ("data", 2), ("tensor", 2)]),
    (Layout(pipeline=2, tensor=2), 4, [("pipeline", 2), ("tensor", 2)]),
])
def test_mesh_dimensions_follow_the_layout(layout: Layout, world: int,
                                           dims: list[tuple[str, int]]) -> None:
    assert mesh_dims(layout.resolve(world)) == dims


def test_the_timed_collectives_plug_into_fsdp2() -> None:
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    comms = timed_comms()
    assert comms is not None, "this torch lacks FSDP2's custom-collective hooks"
    gather, scatter = comms
    assert isinstance(gather, AllGather) and isinstance(scatter, ReduceScatter)
    buf = gather.allocate((3, 4), dtype=torch.float32, device=torch.device("cpu"))
    assert buf.shape == (3, 4)
