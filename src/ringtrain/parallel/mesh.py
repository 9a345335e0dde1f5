"""The device mesh of a layout: one ``DeviceMesh`` whose named dimensions are the groups.

Dimensions, outermost first, only those the layout uses::

    pipeline            p stages
    replicate, data     replicated data parallelism: (d, 1), FSDP2's hybrid mode
    data                sharded data parallelism: d
    tensor              t ranks splitting each layer

The order of :class:`ringtrain.parallel.layout.Layout` (tensor innermost), so the
mesh's coordinates and ``Layout.coords(rank)`` agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringtrain.parallel.layout import Layout

__all__ = ["Mesh", "build_mesh", "mesh_dims"]


def mesh_dims(layout: Layout) -> list[tuple[str, int]]:
    """(name, size) of each mesh dimension for ``layout`` (resolved), outermost first."""
    dims: list[tuple[str, int]] = []
    if layout.pipeline > 1:
        dims.append(("pipeline", layout.pipeline))
    d = layout.data or 1
    if d > 1:
        dims += [("data", d)] if layout.shard else [("replicate", d), ("data", 1)]
    if layout.tensor > 1:
        dims.append(("tensor", layout.tensor))
    return dims


@dataclass(frozen=True)
class Mesh:
    """The mesh and its sub-meshes (None where the layout has no such dimension)."""

    mesh: Any
    pipeline: Any | None
    data: Any | None  #: 1-D ("data") or 2-D ("replicate", "data"): what FSDP2 takes
    tensor: Any | None

    def pipeline_group(self) -> Any:
        return None if self.pipeline is None else self.pipeline.get_group()


def build_mesh(layout: Layout, device_type: str) -> Mesh | None:
    """``init_device_mesh`` for ``layout``; None for a layout of one rank."""
    dims = mesh_dims(layout)
    if not dims:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(name for name, _ in dims)
    mesh = init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=names)
    data = None
    if "replicate" in names:
        data = mesh["replicate", "data"]
    elif "data" in names:
        data = mesh["data"]
    return Mesh(
        mesh=mesh,
        pipeline=mesh["pipeline"] if "pipeline" in names else None,
        data=data,
        tensor=mesh["tensor"] if "tensor" in names else None,
    )
