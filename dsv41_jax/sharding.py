"""The one home for sharding: mesh axis names and the rules that map parameters' logical axes onto them.

Every parameter leaf carries logical axis names (dsv41_jax.params.tensor_specs: "layers", "experts",
"expert_inter", "q_heads", "embed", ...). A rule table maps a logical name to a mesh axis; `partition_spec`
turns a leaf's logical axes into a PartitionSpec for a given mesh, replicating any dim whose size the mesh axis
does not divide (and any name without a rule). Code that places parameters (checkpoints, the engine) uses
these functions, never parameter names.
"""

from __future__ import annotations

from jax.sharding import Mesh, NamedSharding, PartitionSpec

# mesh axis names
EXPERT = "expert"  # expert parallelism (experts split across devices)
TENSOR = "tensor"  # tensor parallelism (heads / intermediate dims split)
DATA = "data"  # data-parallel attention ranks

# logical axis -> mesh axis. Today: experts split over the expert axis (single host), everything else
# replicated; the TP / DEP layouts extend this table.
DEFAULT_RULES: dict[str, str] = {"experts": EXPERT}


def resolve_axis(mesh: Mesh, axis: str, fallback_first: bool = True) -> str | None:
    """A rule's mesh axis if the mesh has it; otherwise the mesh's first axis (single-axis meshes built
    without names, as the checkpoint tools make) when `fallback_first`, else None."""
    if axis in mesh.axis_names:
        return axis
    return mesh.axis_names[0] if fallback_first and len(mesh.axis_names) == 1 else None


def partition_spec(axes: tuple, shape: tuple, mesh: Mesh, rules: dict[str, str] | None = None) -> PartitionSpec:
    rules = DEFAULT_RULES if rules is None else rules
    spec, used = [], set()
    for name, size in zip(axes, shape):
        target = rules.get(name) if name is not None else None
        ax = resolve_axis(mesh, target) if target else None
        if ax is None or ax in used or size % mesh.shape[ax]:
            spec.append(None)
        else:
            spec.append(ax)
            used.add(ax)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(axes: tuple, shape: tuple, mesh: Mesh, rules: dict[str, str] | None = None) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, shape, mesh, rules))
