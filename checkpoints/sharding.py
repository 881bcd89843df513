"""Where each parameter leaf lives: one device, or a NamedSharding per leaf on a mesh.

Rule (simple and enough for one host): the stacked routed-expert leaves ``layers.ffn.experts.*``
([L, E, ...]) are split along the expert axis E over one mesh axis (the mesh axis named "expert" if there
is one, else the first axis) when E divides evenly; every other leaf is replicated. Without a mesh every
leaf is on the default device (`jax.devices()[0]`).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from checkpoints.tree import map_with_path
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import abstract_params


def expert_axis_of(mesh: Mesh, expert_axis: str | None = None) -> str:
    if expert_axis is not None:
        if expert_axis not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {expert_axis!r} (axes {mesh.axis_names})")
        return expert_axis
    return "expert" if "expert" in mesh.axis_names else mesh.axis_names[0]


def leaf_sharding(path: tuple, shape: tuple, mesh: Mesh | None, expert_axis: str | None = None):
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    ax = expert_axis_of(mesh, expert_axis)
    if "experts" in path and len(shape) >= 2 and shape[1] % mesh.shape[ax] == 0:
        return NamedSharding(mesh, PartitionSpec(None, ax))
    return NamedSharding(mesh, PartitionSpec())


def replicated(mesh: Mesh | None):
    """The sharding of a host slab sent to every device that holds part of a leaf."""
    return SingleDeviceSharding(jax.devices()[0]) if mesh is None else NamedSharding(mesh, PartitionSpec())


def param_shardings(cfg: ModelConfig, mesh: Mesh | None = None, expert_axis: str | None = None):
    """A pytree of shardings shaped like the parameters of `cfg`."""
    return map_with_path(lambda p, a: leaf_sharding(p, a.shape, mesh, expert_axis), abstract_params(cfg))


def abstract_sharded(cfg: ModelConfig, mesh: Mesh | None = None, expert_axis: str | None = None):
    """jax.ShapeDtypeStruct leaves with their target shardings (what Orbax restores into)."""
    return map_with_path(
        lambda p, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=leaf_sharding(p, a.shape, mesh, expert_axis)),
        abstract_params(cfg))
