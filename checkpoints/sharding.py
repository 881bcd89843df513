"""Where each parameter leaf lives: one device, or a NamedSharding per leaf on a mesh.

Placement follows each leaf's logical axes (dsv41_jax.params.tensor_specs) through the rule tables of
dsv41_jax.sharding — never parameter names. With a parallel layout (`parallel=`, a dsv41_jax.sharding.Parallel:
what the engine runs) its rules apply, strictly (a dim that does not divide is an error, never silently
replicated). Without one (the checkpoint tools' meshes), the routed-expert axis ("experts") is split over one
mesh axis (the axis named by `expert_axis`, else the mesh's "expert" axis, else its first axis) when the
expert count divides evenly, and every other leaf is replicated. Without a mesh every leaf is on the default
device (`jax.devices()[0]`).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from checkpoints.tree import map_with_path
from dsv41_jax import sharding as logical
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import abstract_params, param_specs


def expert_axis_of(mesh: Mesh, expert_axis: str | None = None) -> str:
    if expert_axis is not None:
        if expert_axis not in mesh.axis_names:
            raise ValueError(f"mesh has no axis {expert_axis!r} (axes {mesh.axis_names})")
        return expert_axis
    return logical.EXPERT if logical.EXPERT in mesh.axis_names else mesh.axis_names[0]


@functools.cache
def _axes_by_path(cfg: ModelConfig) -> dict:
    return {tuple(str(k) for k in path): leaf.axes for path, leaf in param_specs(cfg).items()}


def axes_of(cfg: ModelConfig, path: tuple) -> tuple:
    """The logical axes of the leaf at `path` (keys may be strings or ints)."""
    key = tuple(str(k) for k in path)
    try:
        return _axes_by_path(cfg)[key]
    except KeyError:
        raise KeyError(f"no parameter leaf {'/'.join(key)} in config {cfg.name}") from None


def rules_for(mesh: Mesh, expert_axis: str | None = None, parallel: logical.Parallel | None = None) -> dict:
    """The logical-axis rules a placement on `mesh` uses (the layout's, else experts over one axis)."""
    if parallel is not None:
        if expert_axis is not None:
            raise ValueError("pass either a parallel layout or an expert axis, not both")
        if parallel.axis not in mesh.axis_names:
            raise ValueError(f"mesh axes {mesh.axis_names} lack the {parallel.describe()} axis {parallel.axis!r}")
        return parallel.rules
    return {**logical.DEFAULT_RULES, "experts": expert_axis_of(mesh, expert_axis)}


def leaf_sharding(cfg: ModelConfig, path: tuple, shape: tuple, mesh: Mesh | None, expert_axis: str | None = None,
                  parallel: logical.Parallel | None = None):
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return logical.named_sharding(axes_of(cfg, path), shape, mesh, rules_for(mesh, expert_axis, parallel),
                                  strict=parallel is not None)


def replicated(mesh: Mesh | None):
    """The sharding of a host slab sent to every device that holds part of a leaf."""
    return SingleDeviceSharding(jax.devices()[0]) if mesh is None else NamedSharding(mesh, PartitionSpec())


def param_shardings(cfg: ModelConfig, mesh: Mesh | None = None, expert_axis: str | None = None,
                    parallel: logical.Parallel | None = None):
    """A pytree of shardings shaped like the parameters of `cfg`."""
    return map_with_path(lambda p, a: leaf_sharding(cfg, p, a.shape, mesh, expert_axis, parallel),
                         abstract_params(cfg))


def abstract_sharded(cfg: ModelConfig, mesh: Mesh | None = None, expert_axis: str | None = None,
                     parallel: logical.Parallel | None = None):
    """jax.ShapeDtypeStruct leaves with their target shardings (what Orbax restores into)."""
    return map_with_path(
        lambda p, a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                          sharding=leaf_sharding(cfg, p, a.shape, mesh, expert_axis, parallel)),
        abstract_params(cfg))


def place(cfg: ModelConfig, params: dict, mesh: Mesh, parallel: logical.Parallel) -> dict:
    """Move parameters onto `mesh` with the layout's shardings (leaves already placed so are untouched). The
    tree may be a part of the parameters (host Engram tables: no table leaves)."""
    def put(path, x):
        s = leaf_sharding(cfg, path, x.shape, mesh, parallel=parallel)
        return x if getattr(x, "sharding", None) == s else jax.device_put(x, s)

    return map_with_path(put, params)


def module_shardings(model, mesh: Mesh | None = None, expert_axis: str | None = None,
                     parallel: logical.Parallel | None = None):
    """Shardings for an NNX `DSV41`, read from the logical axes its nnx.Params carry (a tree like its params)."""
    if mesh is None:
        return jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), model.pure_params())
    rules = rules_for(mesh, expert_axis, parallel)
    return jax.tree.map(lambda x, a: logical.named_sharding(a, x.shape, mesh, rules, strict=parallel is not None),
                        model.pure_params(), model.logical_axes(), is_leaf=lambda v: isinstance(v, tuple))
