"""Active-experts-only grouped GEMMs for the routed MoE: y[rows of expert g] = x[rows] @ dequant(w[g])^T.

    grouped_matmul(x [M, K] bf16, w, group_sizes [E] int32, *, scale=None, layer=None) -> [M, N] f32
        (group_sizes as a numpy array: known when traced, the work list becomes a constant of the program)
    grouped_swiglu(x, w1, w3, group_sizes, route_w [M], *, scale1, scale3, layer=None, limit=0., dtype=bf16)
        -> h [M, N] dtype = silu(g) * u * route_w (g, u = the two GEMMs, rounded to dtype first; MXFP4 only)

x rows are sorted by expert: group g is the next group_sizes[g] rows; rows past sum(group_sizes) are padding
(their output rows are 0 here). Weights: bf16 [(L,) E, N, K], or MXFP4: packed uint8 [(L,) E, N, K/2] (two
E2M1 codes per byte, low nibble = even k: the checkpoint's layout, or `tiled` for MoeBlock.layout="tiled",
checkpoints/kernel_layout.py) with E8M0 `scale` [(L,) E, N, K/32] (float8_e8m0fnu or uint8).
A stacked weight is passed whole; `layer` (int32 scalar, may be traced) is read inside the kernel.

Work list (pallas_kernels/moe/worklist.py): the (expert, row tile) items of the *active* experts. Grid = (work item,
N tile, K split); a program of an empty entry exits before touching any weight, so only the active experts' weights
are read and the cost scales with them; split partials [S, M, N] are summed by the wrapper (grouped_swiglu with
splits: g / u partials, the activation then runs in the wrapper). Weight tiles are loaded evict-first (streamed
once). grouped_swiglu streams the w1 and w3 tiles of one (expert, N tile) in one program.

MXFP4 decode (MoeBlock.decode "bf16x2", pallas_kernels.fp_decode): each 32-bit word of packed bytes becomes two
planes of 4 bf16 values with the block scale folded in (w * 2^-8; the f32 sums are multiplied by 2^8), one
inline-asm pass per plane. The planes come out in a fixed k order per tile: for the official layout the wrapper
permutes x's columns to match (`permute_k`), and the x tile halves dot the lo / hi planes: y = x_lo . lo^T +
x_hi . hi^T. decode "e4m3" is the first decoder (nibbles re-placed as e4m3 bytes, converted and scaled, x split
into even / odd columns), kept as the benchmark baseline.

decode "fp8" (fp8_kernel.py): MXFP4 decoded to E4M3 planes and FP8 x FP8 dots with block-scaled f32 sums, x as
FP8 codes (the model's experts get FP8 activations). `quantize_x`: x comes raw and every program quantizes the x
tiles it loads (pallas_kernels/act_quant.py), for both decoders; the model's experts use this.

Numerics contract (grouped_matmul; "fp8": pallas_kernels/fp8dot.py): products exact, f32 accumulation; only the
summation order differs from `ref_grouped_matmul` (the "xla" branch: dequantize all experts,
`lax.ragged_dot_general`): |y - ref| <= ~1e-5 * sum_k |x_k w_k|, for scale codes 7..136 (fp_decode's domain; larger
codes give inf). grouped_swiglu: h within one `dtype` rounding of `ref_grouped_swiglu` (the GEMMs' summation order
and the compiled exp may move g, u or h across a rounding boundary).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import act_quant, fp_decode
from pallas_kernels.common import check_offsets, interpret_default
from pallas_kernels.fp8dot import check_fp8_tiles
from pallas_kernels.fp_decode import FP4_ACC_LOG2, e2m1_planes, fp4_scale_bf16
from pallas_kernels.gemm.kernel import (
    IMPLEMENTATIONS,
    dequant_x,
    expand_tile_scale,
    layer_array,
    qdq_x,
    scale_codes,
    x_codes_f32_scale,
)
from pallas_kernels.moe.block_sizes import DECODES, LAYOUTS, W13_MODES, MoeBlock, pick_moe_block
from pallas_kernels.moe.fp8_kernel import gmm_fp8, swiglu_fp8
from pallas_kernels.moe.worklist import (  # noqa: F401
    call,
    item,
    max_work_items,
    meta,
    out_buffer,
    static_meta,
    swiglu_rows,
    tile_metadata,
)

F32, BF16 = jnp.float32, jnp.bfloat16
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


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


# ----------------------------------------------------------------------------- kernel
def _fp4_planes(w_ref, s_ref, layer, e, n0, kk, blk: MoeBlock, interpret: bool):
    """Decoded (lo, hi) bf16 planes [bn, bk/2] of k tile kk (fp_decode.e2m1_planes); their k order is the
    layout's (official: x is permuted to match by the wrapper; tiled: lo = the tile's first half)."""
    bn, bkp = blk.bn, blk.bk // 2
    b = plt.load(w_ref.at[layer, e, pl.ds(n0, bn), pl.ds(pl.multiple_of(kk * bkp, bkp), bkp)],
                 eviction_policy="evict_first")
    if blk.layout == "official":  # both planes of column j: block j // 16 of the tile
        nb = blk.bk // 32
        s = expand_tile_scale(fp4_scale_bf16(s_ref[layer, e, pl.ds(n0, bn), pl.ds(kk * nb, nb)]), bn, bkp)
        return e2m1_planes(b, s, s, interpret=interpret)
    nb = blk.bk // 64  # tiled: lo plane column j = block j // 32, hi plane = nb blocks later
    s_lo = expand_tile_scale(fp4_scale_bf16(s_ref[layer, e, pl.ds(n0, bn), pl.ds(kk * 2 * nb, nb)]), bn, bkp)
    s_hi = expand_tile_scale(fp4_scale_bf16(s_ref[layer, e, pl.ds(n0, bn), pl.ds(kk * 2 * nb + nb, nb)]), bn, bkp)
    return e2m1_planes(b, s_lo, s_hi, interpret=interpret)


def _legacy_fp4_dot(acc, x_ref, w_ref, s_ref, layer, e, n0, r0, rmask, kk, blk: MoeBlock):
    """The first decoder (kept as the benchmark baseline, `decode="e4m3"`): nibbles re-placed as e4m3 bytes,
    converted to bf16 and scaled in registers, x de-interleaved into even / odd columns."""
    bm, bn, bkp = blk.bm, blk.bn, blk.bk // 2
    k0 = pl.multiple_of(kk * bkp, bkp)
    b = plt.load(w_ref.at[layer, e, pl.ds(n0, bn), pl.ds(k0, bkp)], eviction_policy="evict_first")
    sc = s_ref[layer, e, pl.ds(n0, bn), pl.ds(kk * (bkp // 16), bkp // 16)]
    s = jax.lax.bitcast_convert_type((sc.astype(jnp.int32) + 6) << 23, F32).astype(BF16)
    s = jnp.broadcast_to(s[:, :, None], (bn, bkp // 16, 16)).reshape(bn, bkp)
    w_lo = jax.lax.bitcast_convert_type(((b & 7) << 2) | ((b & 8) << 4), jnp.float8_e4m3fn)
    w_hi = jax.lax.bitcast_convert_type(((b >> 2) & 0x1C) | (b & 0x80), jnp.float8_e4m3fn)
    xt = plt.load(x_ref.at[pl.ds(r0, bm), pl.ds(2 * k0, blk.bk)], mask=rmask, other=0.0)
    xe, xo = (h.reshape(bm, bkp) for h in jax.lax.split(xt.reshape(bm, bkp, 2), (1, 1), axis=2))
    acc = acc + plt.dot(xe, w_lo.astype(BF16) * s, trans_b=True)
    return acc + plt.dot(xo, w_hi.astype(BF16) * s, trans_b=True)


def _dot(acc, xt, wt):
    """acc [bm, bn] += xt [bm, k] . wt [bn, k]^T."""
    return acc + plt.dot(xt, wt, trans_b=True)


def _accumulate(x_ref, w_ref, s_ref, layer, e, n0, r0, rmask, k_lo, ksteps, blk: MoeBlock, fp4: bool,
                interpret: bool, quantize: bool = False):
    """f32 sum over k tiles [k_lo, k_lo + ksteps) of x[rows] . dequant(w[e, n tile])^T: [bm, bn]. quantize: the
    x halves are raw values, put onto the FP8 activation grid here (act_quant; each 32-block spans both halves)."""
    bm, bn, bk = blk.bm, blk.bn, blk.bk

    def body(t, acc):
        kk = k_lo + t
        if fp4 and blk.decode == "e4m3":
            return _legacy_fp4_dot(acc, x_ref, w_ref, s_ref, layer, e, n0, r0, rmask, kk, blk)
        if fp4:
            lo, hi = _fp4_planes(w_ref, s_ref, layer, e, n0, kk, blk, interpret)
            k0 = pl.multiple_of(kk * bk, bk)
            x_lo = plt.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk // 2)], mask=rmask, other=0.0)
            x_hi = plt.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0 + bk // 2, bk // 2)], mask=rmask, other=0.0)
            if quantize:
                x_lo, x_hi = act_quant.qdq_planes(x_lo, x_hi, BF16)
            return _dot(_dot(acc, x_lo, lo), x_hi, hi)
        k0 = pl.multiple_of(kk * bk, bk)
        xt = plt.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=rmask, other=0.0)
        wt = plt.load(w_ref.at[layer, e, pl.ds(n0, bn), pl.ds(k0, bk)], eviction_policy="evict_first")
        return _dot(acc, xt, wt)

    acc = jax.lax.fori_loop(0, ksteps, body, jnp.zeros((bm, bn), F32))
    if fp4 and blk.decode != "e4m3":
        acc = acc * jnp.float32(2.0 ** FP4_ACC_LOG2)  # the planes hold w * 2^-8
    return acc


def _gmm_kernel(layer_ref, meta_ref, *refs, blk: MoeBlock, ksteps: int, fp4: bool, interpret: bool,
                quantize: bool):
    if fp4:
        x_ref, w_ref, s_ref, _, o_ref = refs
    else:
        (x_ref, w_ref, _, o_ref), s_ref = refs, None
    e, r0, lo, hi, rmask, n0 = item(meta_ref, blk, x_ref.shape[0])
    sp = pl.program_id(2)

    @pl.when(hi > lo)
    def _():
        acc = _accumulate(x_ref, w_ref, s_ref, layer_ref[0], e, n0, r0, rmask, sp * ksteps, ksteps, blk, fp4,
                          interpret, quantize)
        plt.store(o_ref.at[sp, pl.ds(r0, blk.bm), pl.ds(n0, blk.bn)], acc, mask=rmask)


def _swiglu_kernel(layer_ref, meta_ref, x_ref, w1_ref, s1_ref, w3_ref, s3_ref, rw_ref, _, o_ref, *,
                   blk: MoeBlock, ksteps: int, limit: float, dtype, interpret: bool, quantize: bool):
    """w1 and w3 tiles of the same (expert, n tile) in one program; one split: the epilogue applies the SwiGLU
    and the routing weight of each row (layers.swiglu's order: g, u rounded to `dtype` first)."""
    e, r0, lo, hi, rmask, n0 = item(meta_ref, blk, x_ref.shape[0])
    sp = pl.program_id(2)
    bm, bn = blk.bm, blk.bn

    @pl.when(hi > lo)
    def _():
        layer = layer_ref[0]
        g = _accumulate(x_ref, w1_ref, s1_ref, layer, e, n0, r0, rmask, sp * ksteps, ksteps, blk, True, interpret,
                        quantize)
        u = _accumulate(x_ref, w3_ref, s3_ref, layer, e, n0, r0, rmask, sp * ksteps, ksteps, blk, True, interpret,
                        quantize)
        if len(o_ref.shape) == 3:  # split K: f32 partials [2 * split + (0: g, 1: u)], the wrapper finishes
            plt.store(o_ref.at[2 * sp, pl.ds(r0, bm), pl.ds(n0, bn)], g, mask=rmask)
            plt.store(o_ref.at[2 * sp + 1, pl.ds(r0, bm), pl.ds(n0, bn)], u, mask=rmask)
            return
        rw = plt.load(rw_ref.at[pl.ds(r0, bm)], mask=rmask[:, 0], other=0.0)
        h = swiglu_rows(g, u, rw[:, None], limit, dtype)
        plt.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], h.astype(o_ref.dtype), mask=rmask)


@functools.partial(jax.jit, static_argnames=("blk", "interpret", "quantize", "owned"))
def _gmm_pallas(x, w, codes, group_sizes, layer, work=None, *, blk: MoeBlock, interpret: bool, quantize: bool = False,
                owned: bool = False):
    M, K = x.shape
    _, E, N, _ = w.shape
    fp4 = codes is not None
    n_items, work = meta(group_sizes, M, E, blk, work)
    if fp4 and blk.decode != "e4m3":
        x = permute_k(x, blk)
    args = [layer, work, x, w] + ([codes] if fp4 else []) + [out_buffer((blk.splits, M, N), F32, owned)]
    y = call(functools.partial(_gmm_kernel, blk=blk, ksteps=K // blk.bk // blk.splits, fp4=fp4,
                               interpret=interpret, quantize=quantize),
             args, jax.ShapeDtypeStruct((blk.splits, M, N), F32), (n_items, N // blk.bn, blk.splits), blk,
             interpret, "moe_gmm_mxfp4" if fp4 else "moe_gmm_bf16")
    return y.reshape(M, N) if blk.splits == 1 else jnp.sum(y, axis=0)


@functools.partial(jax.jit, static_argnames=("blk", "interpret", "limit", "dtype", "quantize", "owned"))
def _swiglu_pallas(x, w1, c1, w3, c3, group_sizes, route_w, layer, *, blk: MoeBlock, interpret: bool,
                   limit: float, dtype, quantize: bool = False, owned: bool = False):
    M, K = x.shape
    _, E, N, _ = w1.shape
    n_items, work = meta(group_sizes, M, E, blk)
    S = blk.splits
    out = ((2 * S, M, N), F32) if S > 1 else ((M, N), dtype)
    args = [layer, work, permute_k(x, blk), w1, c1, w3, c3, route_w.astype(F32), out_buffer(*out, owned)]
    y = call(functools.partial(_swiglu_kernel, blk=blk, ksteps=K // blk.bk // S, limit=limit, dtype=dtype,
                               interpret=interpret, quantize=quantize),
             args, jax.ShapeDtypeStruct(*out), (n_items, N // blk.bn, S), blk, interpret, "moe_swiglu_mxfp4")
    if S == 1:
        return y
    gu = jnp.sum(y.reshape(S, 2, M, N), axis=0)
    return swiglu_rows(gu[0], gu[1], route_w.astype(F32)[:, None], limit, dtype).astype(dtype)


def permute_k(x, blk: MoeBlock):
    """x's columns in the k order of the decoded planes (identity for the tiled layout)."""
    if blk.layout == "tiled":
        return x
    M, K = x.shape
    order = fp_decode.official_k_order(blk.bk)
    return x.reshape(M, K // blk.bk, blk.bk)[:, :, order].reshape(M, K)


def check_moe_block(blk: MoeBlock, N: int, K: int, fp4: bool):
    if blk.w13 not in W13_MODES or (blk.w13 != "joint" and blk.decode != "fp8"):
        raise ValueError(f"block {blk}: w13 in {W13_MODES}; other than 'joint' only with decode 'fp8'")
    if blk.decode == "fp8":
        if not fp4 or blk.layout != "official":
            raise ValueError(f"block {blk}: decode 'fp8' reads MXFP4 experts in the official layout")
        return check_fp8_tiles(blk.bm, blk.nb, blk.bn, blk.bk, N, K, blk.splits, f"block {blk}")
    for name, v in (("bm", blk.bm), ("bn", blk.bn), ("bk", blk.bk)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two >= 16")
    if N % blk.bn or K % (blk.bk * blk.splits) or (fp4 and blk.bk < 64):
        raise ValueError(f"block {blk} does not tile N={N}, K={K} (fp4={fp4})")
    if blk.layout not in LAYOUTS or blk.decode not in DECODES or (blk.layout == "tiled" and blk.bk < 128):
        raise ValueError(f"block {blk}: layout in {LAYOUTS} (tiled: bk >= 128), decode in {DECODES}")
    if blk.decode == "e4m3" and blk.layout != "official":
        raise ValueError(f"block {blk}: the e4m3 decoder reads the official layout")


def _prepare(x, w, group_sizes, scale, layer, block, fp4_required=False, x_scale=None):
    stacked = w.ndim == 4
    if x_scale is not None and (x_scale.shape != (x.shape[0], x.shape[1] // 32) or x.shape[1] % 32):
        raise ValueError(f"x {x.shape} needs x_scale [M, K/32], got {x_scale.shape}")
    layer_arr = layer_array(layer, stacked)
    fp4 = scale is not None
    if fp4 and w.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 weights must be packed uint8, got {w.dtype}")
    if not fp4 and fp4_required:
        raise ValueError("MXFP4 weights need their scale")
    if not fp4 and w.dtype != BF16:
        raise ValueError(f"weights without scale must be bf16, got {w.dtype}")
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
    return M, N, K, E, w4, codes, layer_arr


def _x_for(blk: MoeBlock, x, x_scale, quantize_x: bool):
    """(xq uint8, sx f32 2^(code - 127)) for the FP8 kernels, else x as bf16 (FP8 x dequantized, exactly);
    quantize_x: x as it is (the kernel quantizes it; sx None for the FP8 kernels)."""
    if quantize_x:
        if x_scale is not None:
            raise ValueError("x comes either quantized (x_scale) or to be quantized (quantize_x), not both")
        if blk.decode == "e4m3" or x.shape[1] % 32:
            raise ValueError(f"block {blk}: quantize_x needs K % 32 == 0 and decode 'bf16x2' or 'fp8'")
        return (x, None) if blk.decode == "fp8" else x
    if blk.decode == "fp8":
        if x_scale is None:
            raise ValueError("decode 'fp8' needs x as E4M3 codes with x_scale, or quantize_x")
        return x_codes_f32_scale(x, x_scale)
    return (x if x_scale is None else dequant_x(x, x_scale)).astype(BF16)


def _owned(group_sizes, M: int, all_rows_routed: bool) -> bool:
    """Whether every row belongs to a group (sum(group_sizes) == M): the caller says so (e.g. the N * k routed rows
    of a MoE layer), or the sizes are known now. Then the kernels write every output row and need no zeros."""
    if isinstance(group_sizes, np.ndarray):
        return int(group_sizes.sum()) == M
    return all_rows_routed


def grouped_matmul(x, w, group_sizes, *, scale=None, layer=None, x_scale=None, quantize_x: bool = False,
                   all_rows_routed: bool = False, implementation: str = "pallas", interpret=None,
                   block: MoeBlock | None = None):
    """[M, N] f32; see the module docstring. MXFP4 weights in the official layout unless block.layout says
    tiled (checkpoints/kernel_layout.py). x as FP8 codes with `x_scale` E8M0 codes [M, K/32], or raw with
    `quantize_x` (MXFP4 only; the kernel quantizes it): as in pallas_kernels.gemm.matmul (FP8-dot blocks qualify).
    all_rows_routed: the caller guarantees sum(group_sizes) == M (no padding rows; else their rows are garbage)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}")
    M, N, K, E, w4, codes, layer_arr = _prepare(x, w, group_sizes, scale, layer, block, x_scale=x_scale)
    if implementation == "xla":
        if block is not None and block.layout == "tiled":
            raise ValueError("the xla branch reads the official layout")
        x = x if x_scale is None else dequant_x(x, x_scale)
        return ref_grouped_matmul(qdq_x(x) if quantize_x else x, w, group_sizes, scale=scale, layer=layer)
    fp4 = codes is not None
    if quantize_x and not fp4:
        raise ValueError("quantize_x is for MXFP4 experts")
    x_fp8 = fp4 and (x_scale is not None or quantize_x)
    blk = block or pick_moe_block(M, N, K, fp4=fp4, active=min(M, E), x_fp8=x_fp8)
    check_moe_block(blk, N, K, fp4)
    interpret = interpret_default() if interpret is None else interpret
    work = static_meta(group_sizes, M, E, blk)  # sizes known now (a numpy array): the list is a constant
    gs = group_sizes.astype(jnp.int32)
    xk = _x_for(blk, x, x_scale, quantize_x)
    owned = _owned(group_sizes, M, all_rows_routed)
    if blk.decode == "fp8":
        return gmm_fp8(*xk, w4, codes, gs, layer_arr, work, blk=blk, interpret=interpret, owned=owned)
    return _gmm_pallas(xk, w4, codes, gs, layer_arr, work, blk=blk, interpret=interpret, quantize=quantize_x,
                       owned=owned)


def ref_grouped_swiglu(x, w1, w3, group_sizes, route_w, *, scale1, scale3, layer=None, limit: float = 0.0,
                       dtype=BF16):
    """The model's sequence (layers.routed_experts): two grouped GEMMs rounded to dtype, SwiGLU, routing weight."""
    g = ref_grouped_matmul(x, w1, group_sizes, scale=scale1, layer=layer)
    u = ref_grouped_matmul(x, w3, group_sizes, scale=scale3, layer=layer)
    return swiglu_rows(g, u, route_w.astype(F32)[:, None], limit, dtype).astype(dtype)


def grouped_swiglu(x, w1, w3, group_sizes, route_w, *, scale1, scale3, layer=None, limit: float = 0.0,
                   dtype=BF16, x_scale=None, quantize_x: bool = False, all_rows_routed: bool = False,
                   implementation: str = "pallas", interpret=None, block: MoeBlock | None = None):
    """h [M, N] dtype = (silu(g) * u) * route_w[:, None] with g, u = x @ dequant(w1 / w3)[expert of row]^T
    (MXFP4 experts, both GEMMs and the activation in one kernel; rows sorted by expert as in grouped_matmul;
    `limit` = the model's swiglu_limit, 0 for none). Padding rows come back 0 (all_rows_routed: as grouped_matmul)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}")
    M, N, K, E, w1_4, c1, layer_arr = _prepare(x, w1, group_sizes, scale1, layer, block, True, x_scale)
    _, N3, _, _, w3_4, c3, _ = _prepare(x, w3, group_sizes, scale3, layer, block, True, x_scale)
    if N3 != N or route_w.shape != (M,):
        raise ValueError(f"w1 {w1.shape} / w3 {w3.shape} / route_w {route_w.shape} disagree")
    if implementation == "xla":
        x = x if x_scale is None else dequant_x(x, x_scale)
        return ref_grouped_swiglu(qdq_x(x) if quantize_x else x, w1, w3, group_sizes, route_w, scale1=scale1,
                                  scale3=scale3, layer=layer, limit=limit, dtype=dtype)
    blk = block or pick_moe_block(M, N, K, fp4=True, active=min(M, E), fused=True,
                                  x_fp8=x_scale is not None or quantize_x)
    check_moe_block(blk, N, K, True)
    if blk.decode == "e4m3":
        raise ValueError("grouped_swiglu decodes with fp_decode (decode='bf16x2') or FP8 dots (decode='fp8')")
    interpret = interpret_default() if interpret is None else interpret
    kw = dict(blk=blk, interpret=interpret, limit=float(limit), dtype=jnp.dtype(dtype),
              owned=_owned(group_sizes, M, all_rows_routed))
    gs = group_sizes.astype(jnp.int32)
    xk = _x_for(blk, x, x_scale, quantize_x)
    if blk.decode == "fp8":
        return swiglu_fp8(*xk, w1_4, c1, w3_4, c3, gs, route_w, layer_arr, **kw)
    return _swiglu_pallas(xk, w1_4, c1, w3_4, c3, gs, route_w, layer_arr, quantize=quantize_x, **kw)
