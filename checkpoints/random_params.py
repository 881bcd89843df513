"""Seeded random parameters built directly on the device(s), never materialised on the host.

`random_init(cfg, seed, mesh)` runs `dsv41_jax.params` initialisation (same per-tensor keys, split from
``jax.random.key(seed)`` in `tensor_specs` order, and the same per-tensor init) under jit with out_shardings
from `checkpoints.sharding` (no mesh: uncommitted arrays on the default device, like any jit output).

Memory: one jit of the whole `init_params` keeps the random intermediates of many tensors alive at once
(XLA's CPU memory analysis for `medium`: 545 GiB of temporaries; one stacked expert tensor alone, 140 GiB),
so tensors are generated in bounded programs instead:
- tensors of at most `chunk_elements` (2^28) elements are bundled, up to that many elements per program;
  their values are bit-identical to ``jax.jit(lambda: init_params(cfg, seed))()`` (so for tiny and small,
  whose tensors are all below the bound, random_init == init_params);
- a larger tensor is one program that loops (lax.fori_loop) over chunks of its leading axis (32-row
  aligned for unstacked FP8 linears), chunk i drawn with ``fold_in(tensor_key, i)`` and written in place:
  deterministic and identically distributed, but not the same numbers as init_params (which cannot build
  them on one H200). Keys are arguments of the cached programs: one compile per program per config and mesh,
  whatever the seed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from checkpoints.sharding import leaf_sharding
from checkpoints.tree import flat, unflat
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_rows import drop_tables
from dsv41_jax.params import Tensor, _init_tensor, abstract_params, tensor_specs

CHUNK_ELEMENTS = 2 ** 28


def _name(path) -> str:
    return "/".join(map(str, path))


def chunk_rows(t: Tensor, limit: int = CHUNK_ELEMENTS) -> int | None:
    """Rows of the leading axis per chunk for a tensor over `limit` elements (None: generate it whole)."""
    if math.prod(t.shape) <= limit or len(t.shape) < 2:
        return None
    n0, row = t.shape[0], math.prod(t.shape[1:])
    align = 32 if t.fmt == "lin" and len(t.shape) == 2 else 1  # FP8 32x32 blocks of an unstacked linear
    divisors = {d for i in range(1, math.isqrt(n0) + 1) if n0 % i == 0 for d in (i, n0 // i)}
    ok = [c for c in divisors if c < n0 and c % align == 0 and c * row <= limit]
    return max(ok) if ok else None


def _chunked(cfg: ModelConfig, path, t: Tensor, c: int):
    """fn(key) -> {leaf name: array} for tensor `t` built chunk by chunk (c leading rows each)."""
    n = t.shape[0] // c
    sub = dataclasses.replace(t, shape=(c, *t.shape[1:]))

    def fn(key):
        probe = jax.eval_shape(lambda k: _init_tensor(cfg, k, sub, path), key)
        bufs = {p: jnp.zeros((n * s.shape[0], *s.shape[1:]), s.dtype) for p, s in probe.items()}

        def body(i, bufs):
            vals = _init_tensor(cfg, jax.random.fold_in(key, i), sub, path)
            return {p: lax.dynamic_update_slice_in_dim(bufs[p], vals[p], i * vals[p].shape[0], 0) for p in bufs}

        return {_name(p): v for p, v in lax.fori_loop(0, n, body, bufs).items()}

    return fn


def _bundle(cfg: ModelConfig, items):
    def fn(keys):
        out = {}
        for i, (path, t) in enumerate(items):
            out.update({_name(p): v for p, v in _init_tensor(cfg, keys[i], t, path).items()})
        return out

    return fn


def plan(cfg: ModelConfig, chunk_elements: int = CHUNK_ELEMENTS, tables: bool = True):
    """[(kind, [(index, path, Tensor)], chunk rows)]: bundles of small tensors and single chunked tensors
    (`tables=False`: without the Engram tables; every other tensor keeps its key and values)."""
    groups, cur, size = [], [], 0
    for i, (path, t) in enumerate(tensor_specs(cfg).items()):
        if not tables and t.fmt == "table":
            continue
        c = chunk_rows(t, chunk_elements)
        if c is not None:
            groups.append(("chunked", [(i, path, t)], c))
            continue
        n = math.prod(t.shape)
        if cur and size + n > chunk_elements:
            groups.append(("bundle", cur, None))
            cur, size = [], 0
        cur.append((i, path, t))
        size += n
    if cur:
        groups.append(("bundle", cur, None))
    return groups


@functools.cache
def _program(cfg: ModelConfig, group: int, mesh, expert_axis, chunk_elements: int, parallel=None, tables=True):
    """The jitted program of one plan group (cached: a new seed reuses it)."""
    kind, items, c = plan(cfg, chunk_elements, tables)[group]
    if kind == "chunked":
        fn = _chunked(cfg, items[0][1], items[0][2], c)
    else:
        fn = _bundle(cfg, [(p, t) for _, p, t in items])
    if mesh is None:
        return jax.jit(fn)
    shapes = {_name(p): a.shape for p, a in flat(abstract_params(cfg)).items()}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype) if kind == "chunked" else \
        jax.ShapeDtypeStruct((len(items),), jax.random.key(0).dtype)
    names = jax.eval_shape(fn, key).keys()
    return jax.jit(fn, out_shardings={n: leaf_sharding(cfg, tuple(n.split("/")), shapes[n], mesh, expert_axis,
                                                       parallel) for n in names})


def random_init(cfg: ModelConfig, seed: int = 0, mesh=None, expert_axis: str | None = None, *,
                chunk_elements: int = CHUNK_ELEMENTS, parallel=None, tables: bool = True) -> dict:
    """`parallel` (a dsv41_jax.sharding.Parallel): place every leaf by that layout's rules on `mesh`.
    `tables=False`: no Engram table (host tables: checkpoints.host_tables.from_random makes them)."""
    keys = jax.random.split(jax.random.key(seed), len(tensor_specs(cfg)))
    leaves = {}
    for g, (kind, items, _) in enumerate(plan(cfg, chunk_elements, tables)):
        idx = np.array([i for i, _, _ in items])
        prog = _program(cfg, g, mesh, expert_axis, chunk_elements, parallel, tables)
        leaves.update(prog(keys[idx[0]] if kind == "chunked" else keys[idx]))
    specs = abstract_params(cfg) if tables else drop_tables(abstract_params(cfg))
    return unflat(specs, {p: leaves[_name(p)] for p in flat(specs)})
