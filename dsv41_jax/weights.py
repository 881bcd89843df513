"""Views of one layer's weights inside the stacked parameter tree, without copying them.

The parameters keep every per-layer tensor stacked ([L, ...], [n_sources, ...]) so the layers run under
lax.scan. Slicing layer l out of a stack (`dynamic_index_in_dim`) makes XLA materialise a copy of that slice
at every step: for the GEMM weights of V4.1 that is every weight byte copied once per decode step. A
`LayerRef` names layer l of a (sub)tree without slicing: `ref.get()` returns the sliced arrays (what the XLA
reference ops consume; slices nobody uses are removed by XLA), while a kernel takes `ref.stack` plus
`ref.index` and reads the layer's bytes in place.
"""

from __future__ import annotations

import jax


class LayerRef:
    """Layer `index` (a traced int32 scalar) of the stacked tree `stack` (a dict of arrays / dicts)."""

    __slots__ = ("stack", "index")

    def __init__(self, stack, index):
        self.stack, self.index = stack, index

    def __getitem__(self, key) -> LayerRef:
        return LayerRef(self.stack[key], self.index)

    def __contains__(self, key) -> bool:
        return key in self.stack

    def get(self):
        """The layer's arrays (dynamic slices of the stacks)."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, keepdims=False), self.stack)


def materialize(p):
    """A LayerRef's arrays, or `p` itself when it is already a plain tree."""
    return p.get() if isinstance(p, LayerRef) else p
