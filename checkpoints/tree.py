"""Parameter-tree helpers: leaves addressed by plain path tuples, as `dsv41_jax.params.param_specs` names them.

A path is a tuple of dict keys and list indices, e.g. ``("layers", "attn", "wq_a", "weight")`` or
``("engram", 0, "embed", "scale")``. `flat` / `unflat` convert between a pytree and {path: leaf} without
changing the tree structure (unflat takes the structure from a template such as `abstract_params(cfg)`).
"""

from __future__ import annotations

import jax


def _key(k):
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise TypeError(f"unsupported pytree key {k!r}")


def flat(tree) -> dict:
    """{path tuple: leaf} in pytree order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(_key(k) for k in kp): v for kp, v in leaves}


def unflat(template, leaves: dict):
    """A tree shaped like `template` whose leaves are `leaves[path]` (every path must be present)."""
    kps, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [leaves[tuple(_key(k) for k in kp)] for kp, _ in kps])


def map_with_path(fn, tree):
    """tree_map with the plain path tuple as the first argument."""
    return jax.tree_util.tree_map_with_path(lambda kp, v: fn(tuple(_key(k) for k in kp), v), tree)


def nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))
