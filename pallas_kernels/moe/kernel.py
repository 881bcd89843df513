"""Active-experts-only grouped GEMM for the routed MoE: y[rows of expert g] = x[rows] @ dequant(w[g])^T, f32.

    grouped_matmul(x [M, K] bf16, w, group_sizes [E] int32, *, scale=None, layer=None) -> [M, N] f32

x rows are sorted by expert: group g is the next group_sizes[g] rows; rows past sum(group_sizes) are padding
(their output rows are 0 here). Weights: bf16 [(L,) E, N, K], or MXFP4: packed uint8 [(L,) E, N, K/2] (two
E2M1 codes per byte, low nibble = even k) with E8M0 `scale` [(L,) E, N, K/32] (float8_e8m0fnu or uint8).
A stacked weight is passed whole; `layer` (int32 scalar, may be traced) is read inside the kernel.

Work list: `tile_metadata` (jnp, from group_sizes) lists the (expert, row tile) pairs of the *active* experts,
padded to a static length with empty entries. Grid = (work item, N tile); a program of an empty entry exits
before touching any weight, so only the active experts' weights are read and the cost scales with them. A row
tile that does not start at a multiple of bm is shifted down to stay inside x (rows outside the item's range
are masked at the x loads and at the store); each output row is stored by exactly one program per N tile, into
a zero-initialised aliased buffer. Weight tiles are loaded evict-first (streamed once).

MXFP4 decode in registers, without FP4 types: a code c = (s, e1, e0, m) re-placed as the e4m3 byte
s<<7 | e1 e0 m <<2 has the value e2m1(c) / 64 (normal and subnormal codes alike), so the tile is
bitcast(bytes -> e4m3) -> bf16 times 2^(scale - 121) (exact). The two nibble planes dot the even / odd
columns of the x tile (de-interleaved in registers with a split): y = x_even . w_lo^T + x_odd . w_hi^T.

Numerics contract: products exact, f32 accumulation; only the summation order differs from `ref_grouped_matmul`
(the "xla" branch: dequantize all experts, `lax.ragged_dot_general`): |y - ref| <= ~1e-5 * sum_k |x_k w_k|.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import check_offsets, interpret_default
from pallas_kernels.gemm.kernel import IMPLEMENTATIONS, layer_array, scale_codes
from pallas_kernels.moe.block_sizes import MoeBlock, pick_moe_block

F32, BF16 = jnp.float32, jnp.bfloat16
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
META_FIELDS = 4  # expert, first row loaded (r0), first row owned (lo), end of owned rows (hi)


# ----------------------------------------------------------------------------- reference ("xla" branch)
def dequant_mxfp4(packed, scale, dtype=BF16):
    """[.., N, K/2] packed E2M1 + [.., N, K/32] E8M0 -> [.., N, K] dtype (the model's expert_weight)."""
    p = packed.astype(jnp.int32)
    codes = jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    v = jnp.asarray(FP4_VALUES, F32)[codes]
    c = scale_codes(scale).astype(jnp.int32)
    s = jnp.where(c == 0, jnp.float32(2.0 ** -127), jax.lax.bitcast_convert_type(c << 23, F32))
    v = v.reshape(*v.shape[:-1], -1, 32) * s[..., None]
    return v.reshape(*codes.shape).astype(dtype)


def ref_grouped_matmul(x, w, group_sizes, *, scale=None, layer=None):
    """What the model does today: slice the layer, dequantize every expert, ragged_dot over all of them."""
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
        if scale is not None:
            scale = jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)
    wd = dequant_mxfp4(w, scale) if scale is not None else w.astype(BF16)
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                           rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(x.astype(BF16), wd, group_sizes.astype(jnp.int32), dn,
                                      preferred_element_type=F32)


# ----------------------------------------------------------------------------- work list
def max_work_items(M: int, E: int, bm: int) -> int:
    """Upper bound of sum_g ceil(size_g / bm) over sizes with sum <= M: M // bm + (number of nonempty groups)."""
    return M // bm + min(E, M)


def _cumsum(v):
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
    ends = jnp.minimum(_cumsum(sizes), M)
    starts = jnp.minimum(ends - sizes, M)
    tiles = (ends - starts + bm - 1) // bm
    tend = _cumsum(tiles)
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


# ----------------------------------------------------------------------------- kernel
def _gmm_kernel(layer_ref, meta_ref, *refs, blk: MoeBlock, ksteps: int, fp4: bool):
    if fp4:
        x_ref, w_ref, s_ref, _, o_ref = refs
    else:
        x_ref, w_ref, _, o_ref = refs
    bm, bn, bk = blk.bm, blk.bn, blk.bk
    t, j = pl.program_id(0), pl.program_id(1)
    e, r0, lo, hi = (meta_ref[t, f] for f in range(META_FIELDS))
    n0 = pl.multiple_of(j * bn, bn)

    @pl.when(hi > lo)
    def _():
        layer = layer_ref[0]
        rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        rmask = (rows >= lo) & (rows < hi)  # other experts' rows are neither loaded nor stored

        def body(kk, acc):
            if fp4:
                bkp = bk // 2
                k0 = pl.multiple_of(kk * bkp, bkp)
                b = plt.load(w_ref.at[layer, e, pl.ds(n0, bn), pl.ds(k0, bkp)], eviction_policy="evict_first")
                sc = s_ref[layer, e, pl.ds(n0, bn), pl.ds(kk * (bkp // 16), bkp // 16)]
                s = jax.lax.bitcast_convert_type((sc.astype(jnp.int32) + 6) << 23, F32).astype(BF16)
                s = jnp.broadcast_to(s[:, :, None], (bn, bkp // 16, 16)).reshape(bn, bkp)
                w_lo = jax.lax.bitcast_convert_type(((b & 7) << 2) | ((b & 8) << 4), jnp.float8_e4m3fn)
                w_hi = jax.lax.bitcast_convert_type(((b >> 2) & 0x1C) | (b & 0x80), jnp.float8_e4m3fn)
                xt = plt.load(x_ref.at[pl.ds(r0, bm), pl.ds(2 * k0, bk)], mask=rmask, other=0.0)
                xe, xo = (h.reshape(bm, bkp) for h in jax.lax.split(xt.reshape(bm, bkp, 2), (1, 1), axis=2))
                acc = acc + plt.dot(xe, w_lo.astype(BF16) * s, trans_b=True)
                return acc + plt.dot(xo, w_hi.astype(BF16) * s, trans_b=True)
            k0 = pl.multiple_of(kk * bk, bk)
            xt = plt.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=rmask, other=0.0)
            wt = plt.load(w_ref.at[layer, e, pl.ds(n0, bn), pl.ds(k0, bk)], eviction_policy="evict_first")
            return acc + plt.dot(xt, wt, trans_b=True)

        acc = jax.lax.fori_loop(0, ksteps, body, jnp.zeros((bm, bn), F32))
        plt.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], acc, mask=rmask)


@functools.partial(jax.jit, static_argnames=("blk", "interpret"))
def _gmm_pallas(x, w, codes, group_sizes, layer, *, blk: MoeBlock, interpret: bool):
    M, K = x.shape
    _, E, N, _ = w.shape
    fp4 = codes is not None
    n_items = max_work_items(M, E, blk.bm)
    meta = tile_metadata(group_sizes, M, blk.bm, n_items)
    args = [layer, meta, x, w] + ([codes] if fp4 else []) + [jnp.zeros((M, N), F32)]
    anyspec = pl.BlockSpec(memory_space=pl.ANY)
    y = pl.pallas_call(
        functools.partial(_gmm_kernel, blk=blk, ksteps=K // blk.bk, fp4=fp4),
        out_shape=jax.ShapeDtypeStruct((M, N), F32),
        grid=(n_items, N // blk.bn),
        in_specs=[anyspec] * len(args),
        out_specs=anyspec,
        input_output_aliases={len(args) - 1: 0},
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=blk.num_stages),
        interpret=interpret,
        name="moe_gmm_mxfp4" if fp4 else "moe_gmm_bf16",
    )(*args)
    return y


def check_moe_block(blk: MoeBlock, N: int, K: int, fp4: bool):
    for name, v in (("bm", blk.bm), ("bn", blk.bn), ("bk", blk.bk)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two >= 16")
    if N % blk.bn or K % blk.bk or (fp4 and blk.bk < 32):
        raise ValueError(f"block {blk} does not tile N={N}, K={K} (fp4={fp4})")


def grouped_matmul(x, w, group_sizes, *, scale=None, layer=None, implementation: str = "pallas", interpret=None,
                   block: MoeBlock | None = None):
    """[M, N] f32; see the module docstring."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}")
    stacked = w.ndim == 4
    layer_arr = layer_array(layer, stacked)
    fp4 = scale is not None
    if fp4 and w.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 weights must be packed uint8, got {w.dtype}")
    if not fp4 and w.dtype != BF16:
        raise ValueError(f"weights without scale must be bf16, got {w.dtype}")
    if implementation == "xla":
        return ref_grouped_matmul(x, w, group_sizes, scale=scale, layer=layer)
    M, K = x.shape
    E, N = w.shape[-3], w.shape[-2]
    if w.shape[-1] * (2 if fp4 else 1) != K:
        raise ValueError(f"x {x.shape} and w {w.shape} disagree on K")
    if group_sizes.shape != (E,):
        raise ValueError(f"group_sizes {group_sizes.shape} != ({E},)")
    w4 = w if stacked else w[None]
    codes = None
    if fp4:
        codes = scale_codes(scale)
        codes = codes if stacked else codes[None]
        if codes.shape[-3:] != (E, N, K // 32) or K % 32:
            raise ValueError(f"MXFP4 weight {w.shape} needs K % 32 == 0 and scale [.., E, N, K/32]")
    check_offsets(w4, *([codes] if fp4 else []))
    blk = block or pick_moe_block(M, N, K, fp4=fp4, active=min(M, E))
    check_moe_block(blk, N, K, fp4)
    interpret = interpret_default() if interpret is None else interpret
    return _gmm_pallas(x.astype(BF16), w4, codes, group_sizes.astype(jnp.int32), layer_arr, blk=blk,
                       interpret=interpret)
