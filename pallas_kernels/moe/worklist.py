"""The pieces both MoE kernels share (kernel.py: bf16 / MXFP4 with bf16 dots; fp8_kernel.py: FP8 x FP8 dots):
the work list of active (expert, row tile) items, a program's item, the SwiGLU epilogue, the pallas_call.

Work list: `tile_metadata` (jnp, from group_sizes) lists the (expert, row tile) pairs of the *active* experts,
padded to a static length with empty entries; a program of an empty entry exits before touching any weight.
A kernel's `meta` operand is either that list [n_items, 4] (built at trace time when the sizes are known:
`static_meta`) or the group sizes themselves, zero-padded to a power of two [Ep] (`meta`): each program then derives
its own entry from them (`item`, the same arithmetic as tile_metadata, on a few hundred integers), so routing costs
no separate kernels to build the list.
A row tile that does not start at a multiple of bm is shifted down to stay inside x (rows outside the item's range
are masked at the loads and at the store); each output row is stored by exactly one program per (N tile, split),
into a zero-initialised aliased buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32
META_FIELDS = 4  # expert, first row loaded (r0), first row owned (lo), end of owned rows (hi)


def max_work_items(M: int, E: int, bm: int) -> int:
    """Upper bound of sum_g ceil(size_g / bm) over sizes with sum <= M: M // bm + (number of nonempty groups)."""
    return M // bm + min(E, M)


def cumsum_small(v):
    """Inclusive prefix sum of a short int vector as one masked reduction (jnp.cumsum lowers to a scan that
    may become a serial while loop, which syncs with the host every iteration on the GPU)."""
    i = jnp.arange(v.shape[0])
    return jnp.sum(jnp.where(i[None, :] <= i[:, None], v[None, :], 0), axis=1).astype(v.dtype)


def tile_metadata(group_sizes, M: int, bm: int, n_items: int):
    """int32 [n_items, 4]: (expert, r0, lo, hi) for each row tile of each active expert, in expert order, then
    empty entries (lo == hi). Rows [lo, hi) are the tile's own rows; the kernel addresses rows [r0, r0 + bm)
    with r0 = max(min(lo, M - bm), 0), inside x unless M < bm (then rows >= M are masked off). Entries past
    n_items are dropped (never happens when sum(group_sizes) <= M and n_items = max_work_items)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(cumsum_small(sizes), M)
    starts = jnp.minimum(ends - sizes, M)
    tiles = (ends - starts + bm - 1) // bm
    tend = cumsum_small(tiles)
    t = jnp.arange(n_items, dtype=jnp.int32)
    e = jnp.searchsorted(tend, t, side="right", method="compare_all")
    e = jnp.minimum(e, sizes.shape[0] - 1).astype(jnp.int32)
    valid = t < tend[-1]
    lo = starts[e] + (t - (tend[e] - tiles[e])) * bm
    hi = jnp.minimum(lo + bm, ends[e])
    lo = jnp.where(valid, lo, 0)
    hi = jnp.where(valid, hi, 0)
    e = jnp.where(valid, e, 0)
    r0 = jnp.maximum(jnp.minimum(lo, M - bm), 0)
    return jnp.stack([e, r0, lo, hi], axis=1).astype(jnp.int32)


def item(meta_ref, blk, m_rows: int):
    """(expert, r0, lo, hi, mask of the rows [r0, r0 + bm) the item owns [bm, 1], first column of the N tile) of
    this program's work item: read from the work list [n_items, 4], or derived from the padded sizes [Ep]."""
    t, j = pl.program_id(0), pl.program_id(1)
    if len(meta_ref.shape) == 2:
        e, r0, lo, hi = (meta_ref[t, f] for f in range(META_FIELDS))
    else:
        e, r0, lo, hi = _item_from_sizes(meta_ref[...], t, m_rows, blk.bm)
    rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (blk.bm, 1), 0)
    return e, r0, lo, hi, (rows >= lo) & (rows < hi), pl.multiple_of(j * blk.bn, blk.bn)


def _item_from_sizes(sizes, t, M: int, bm: int):
    """Entry t of tile_metadata(sizes, M, bm, ...) as four int32 scalars, by the same arithmetic: prefix sums
    (jnp.cumsum, which Pallas Triton lowers to a scan), a count for the search, one-hot sums for the gathers."""
    sizes = jnp.maximum(sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), M)
    starts = jnp.minimum(ends - sizes, M)
    tiles = (ends - starts + bm - 1) // bm
    tend = jnp.cumsum(tiles)
    e = jnp.minimum(jnp.sum((tend <= t).astype(jnp.int32)), sizes.shape[0] - 1)  # searchsorted(side="right")
    hot = jax.lax.broadcasted_iota(jnp.int32, sizes.shape, 0) == e

    def at_e(v):
        return jnp.sum(jnp.where(hot, v, 0))

    valid = t < jnp.max(tend)
    lo = at_e(starts) + (t - (at_e(tend) - at_e(tiles))) * bm
    hi = jnp.minimum(lo + bm, at_e(ends))
    lo, hi, e = (jnp.where(valid, v, 0) for v in (lo, hi, e))
    return e, jnp.maximum(jnp.minimum(lo, M - bm), 0), lo, hi


def swiglu_rows(g, u, rw, limit: float, dtype):
    """layers.swiglu(g, u) * rw on f32 GEMM outputs first rounded to `dtype` (what the reference feeds it)."""
    g, u = g.astype(dtype).astype(F32), u.astype(dtype).astype(F32)
    if limit > 0:
        u = jnp.clip(u, -limit, limit)
        g = jnp.minimum(g, limit)
    return jax.nn.silu(g) * u * rw  # Pallas Triton lowers the logistic as 1 / (1 + exp(-g))


def meta(group_sizes, M: int, E: int, blk, work=None):
    """(n_items, the kernels' `meta` operand): `work` (the list already built, `static_meta`) as is, else the group
    sizes zero-padded to a power of two (Triton's vectors), from which each program derives its item."""
    n_items = max_work_items(M, E, blk.bm) if work is None else work.shape[0]
    if work is not None:
        return n_items, work
    ep = 1 << max(0, (E - 1).bit_length())
    sizes = group_sizes.astype(jnp.int32)
    return n_items, sizes if ep == E else jnp.pad(sizes, (0, ep - E))


def static_meta(group_sizes, M: int, E: int, blk):
    """The work list of group sizes known when the program is traced (a numpy array, e.g. WO-A's G groups of B*T
    rows), built now: a constant of the program instead of a few small kernels per call. None otherwise."""
    if not isinstance(group_sizes, np.ndarray):
        return None
    # built on the host's CPU device (a program traced for a compile-only GPU cannot run ops on it)
    with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
        gs = jnp.asarray(group_sizes, jnp.int32)
        return np.asarray(tile_metadata(gs, M, blk.bm, max_work_items(M, E, blk.bm)))


def out_buffer(shape, dtype, owned: bool, init=None):
    """The kernels' output operand: None when every row is owned by a work item (`owned`: sum(group_sizes) == M,
    e.g. all N * k routed rows), so the kernels write every element and the pallas_call allocates the buffer; else
    zeros (`init`, a seam the tests poison), aliased, so rows no item owns (padding) read 0."""
    if owned:
        return None
    return (init or jnp.zeros)(shape, dtype)


def call(kernel, args, out_shape, grid, blk, interpret: bool, name: str):
    """pallas_call over raw refs; the last argument is the output buffer (`out_buffer`): zero-initialised and
    aliased, or None (the kernel's ref for it is then None too, and the output is the call's own)."""
    anyspec = pl.BlockSpec(memory_space=pl.ANY)
    aliases = {len(args) - 1: 0}
    if args[-1] is None:
        args, aliases = args[:-1], {}
        body = kernel

        def kernel(*refs):
            return body(*refs[:-1], None, refs[-1])
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=[anyspec] * len(args), out_specs=anyspec,
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=blk.num_stages),
        interpret=interpret, name=name)(*args)
