"""Small-M GEMM on weights in their checkpoint formats: y = x @ dequant(w)^T, f32 output.

    matmul(x [M, K] bf16, w [N, K] or stacked [L, N, K], *, scale=None, layer=None, x_scale=None) -> [M, N] f32

x may come as FP8: E4M3 codes [M, K] (float8_e4m3fn or uint8) with `x_scale` E8M0 codes [M, K/32] (the model's
quantized activations, dsv41_jax.quant.fp8_encode; x = codes * 2^(x_scale - 127)) or, as f32, those multipliers
themselves (pallas_kernels/act_quant_kernel.py). FP8 weights then run the FP8 x
FP8 dot of fp8_kernel.py where the block says decode="fp8"; the other paths dequantize x first (exact). Or x comes
raw (bf16 / f32) with `quantize_x`: each program quantizes the x tiles it loads (pallas_kernels/act_quant.py, the
same rule and values), so the model's FP8 activations cost no XLA kernels (the model's FP8 linears use this).

Weights: bf16, or float8_e4m3fn with one E8M0 scale per 32x32 tile (`scale` [(L,) N/32, K/32], dtype float8_e8m0fnu
or raw uint8 codes; dsv41_jax.quant.quantize_weight_fp8). A stacked weight is passed whole and the `layer` (an int32
scalar, may be traced) is read inside the kernel, so no per-layer slice is ever copied.

Kernel (Pallas Triton): grid (M tiles, N tiles, K splits); a program streams [bn, bk] weight tiles of one layer over
its K range, decodes FP8 tiles to bf16 in registers (decode "bf16x2": pallas_kernels.fp_decode's inline-asm bit
decode with the tile's power-of-two scale folded in; "convert": e4m3 -> bf16 convert times the scale; both exact)
and accumulates `plt.dot` in f32 (swap: the weight tile is the dot's M operand). K splits write f32 partials [S, Mp,
N] that the wrapper sums. The M tile (>= 16, the dot minimum) may overhang x: rows past M are masked off at the x
load and land in padded f32 output rows that the wrapper slices off (jax 0.11.2's Triton lowering does not mask a
block that overhangs an array: an unpadded output would be written past its end). Weight tiles are loaded evict-
first.

Numerics contract (decode "bf16x2" / "convert"; "fp8": pallas_kernels/fp8dot.py): every product is exact (bf16 x
bf16, or bf16 x e4m3 * 2^k, both exactly representable) and accumulated in f32; only the summation order differs
from the reference `ref_matmul` (the "xla" branch: dequantize, then einsum with f32 accumulation), so |y - ref| <=
~1e-5 * sum_k |x_k w_k| (tested).

Limits: N, K multiples of 32 (FP8) or 16 (bf16). 1-byte arrays of 2..4 GiB (one layer's MXFP4 experts) need the
64-bit offset fix of pallas_kernels.common.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import act_quant
from pallas_kernels.common import _widen_for_offsets, check_offsets, e8m0_to_f32, interpret_default, split_bf16x3  # noqa: F401
from pallas_kernels.fp8dot import check_fp8_tiles
from pallas_kernels.fp_decode import e4m3_scaled, fp8_scale_bf16
from pallas_kernels.gemm.block_sizes import DECODES, GemmBlock, pick_gemm_block
from pallas_kernels.gemm.fp8_kernel import matmul_fp8

F32, BF16 = jnp.float32, jnp.bfloat16
IMPLEMENTATIONS = ("pallas", "xla")


# ----------------------------------------------------------------------------- shared helpers
def scale_codes(scale):
    """E8M0 scales (float8_e8m0fnu or uint8 codes) -> uint8 codes."""
    if scale.dtype == jnp.uint8:
        return scale
    return jax.lax.bitcast_convert_type(scale, jnp.uint8)


def layer_array(layer, stacked: bool):
    if stacked and layer is None:
        raise ValueError("a stacked weight needs `layer`")
    if not stacked and layer is not None:
        raise ValueError("`layer` given for an unstacked weight")
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)


def expand_tile_scale(s, rows: int, cols: int):
    """[rows/r, cols/c] per-tile scales -> [rows, cols] (broadcast + reshape, Triton-lowerable)."""
    a, b = s.shape
    r, c = rows // a, cols // b
    return jnp.broadcast_to(s[:, None, :, None], (a, r, b, c)).reshape(rows, cols)


def dequant_fp8_tile(w, codes):
    """e4m3 tile [bn, bk] and its E8M0 codes [bn/32, bk/32] -> bf16 tile (exact)."""
    s = expand_tile_scale(e8m0_to_f32(codes).astype(BF16), *w.shape)
    return w.astype(BF16) * s


# ----------------------------------------------------------------------------- reference ("xla" branch)
def dequant_fp8(q, scale, dtype=BF16, block: int = 32):
    """[.., N, K] e4m3 with [.., N/32, K/32] E8M0 scales -> dtype (the model's lin_weight)."""
    s = jax.lax.bitcast_convert_type(scale_codes(scale).astype(jnp.int32) << 23, F32)
    s = jnp.where(scale_codes(scale) == 0, jnp.float32(2.0 ** -127), s)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :q.shape[-2], :q.shape[-1]]
    return (q.astype(F32) * s).astype(dtype)


def x_multipliers(x_scale):
    """x's block scales as f32 multipliers 2^(code - 127): given as E8M0 codes (uint8 / float8_e8m0fnu), or already
    as f32 multipliers (pallas_kernels/act_quant_kernel.py's output)."""
    if x_scale.dtype == F32:
        return x_scale
    return jax.lax.bitcast_convert_type(scale_codes(x_scale).astype(jnp.int32) << 23, F32)


def dequant_x(xq, x_scale, dtype=BF16):
    """FP8 activations (E4M3 codes [M, K], block scales [M, K/32]: `x_multipliers`) -> dtype (exact for bf16)."""
    xq = jax.lax.bitcast_convert_type(xq, jnp.float8_e4m3fn) if xq.dtype == jnp.uint8 else xq
    s = x_multipliers(x_scale)
    M, K = xq.shape
    return (xq.astype(F32).reshape(M, K // 32, 32) * s[:, :, None]).reshape(M, K).astype(dtype)


def x_codes_f32_scale(xq, x_scale):
    """(uint8 E4M3 codes [M, K], f32 block multipliers [M, K/32]: `x_multipliers`) for the FP8 kernels."""
    xq = jax.lax.bitcast_convert_type(xq, jnp.uint8) if xq.dtype != jnp.uint8 else xq
    return xq, x_multipliers(x_scale)


def qdq_x(x):
    """x [M, K] on the FP8 activation grid (pallas_kernels/act_quant.py), as bf16 (exact): what `quantize_x` does
    in the kernels, in XLA."""
    if x.shape[-1] % 32:
        raise ValueError(f"quantize_x needs K % 32 == 0, got x {x.shape}")
    return act_quant.qdq_tile(x, BF16)


def ref_matmul(x, w, *, scale=None, layer=None, x_scale=None, quantize_x: bool = False):
    """What the model does today: slice the layer, dequantize to bf16, einsum with f32 accumulation."""
    if x_scale is not None:
        x = dequant_x(x, x_scale)
    if quantize_x:
        x = qdq_x(x)
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
        if scale is not None:
            scale = jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False)
    wd = dequant_fp8(w, scale) if scale is not None else w.astype(BF16)
    return jnp.einsum("mk,nk->mn", x.astype(BF16), wd, preferred_element_type=F32)


# ----------------------------------------------------------------------------- kernel
def _mm_kernel(layer_ref, x_ref, w_ref, *rest, blk: GemmBlock, ksteps: int, fp8: bool, m_rows: int,
               interpret: bool, quantize: bool):
    s_ref, o_ref = rest if fp8 else (None, rest[0])
    bm, bn, bk = blk.bm, blk.bn, blk.bk
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    m0 = pl.multiple_of(i * bm, bm)
    n0 = pl.multiple_of(j * bn, bn)
    kbase = s * (ksteps * bk)
    rmask = (m0 + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < m_rows  # padding rows are not loaded

    def body(t, acc):
        k0 = pl.multiple_of(kbase + t * bk, bk)
        xt = plt.load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mask=rmask, other=0.0)
        if quantize:  # x onto the FP8 activation grid as it is loaded (exact in bf16)
            xt = act_quant.qdq_tile(xt, BF16)
        wt = plt.load(w_ref.at[layer, pl.ds(n0, bn), pl.ds(k0, bk)], eviction_policy="evict_first")
        if fp8:
            kb0 = s * (ksteps * bk // 32) + t * (bk // 32)  # k0 / 32 without a signed division
            codes = s_ref[layer, pl.ds(j * (bn // 32), bn // 32), pl.ds(kb0, bk // 32)]
            if blk.decode == "bf16x2":  # fp_decode: bytes -> scaled bf16 in one inline-asm pass
                wt = e4m3_scaled(wt, expand_tile_scale(fp8_scale_bf16(codes), bn, bk), interpret=interpret)
            else:
                wt = dequant_fp8_tile(wt, codes)
        return acc + (plt.dot(wt, xt, trans_b=True) if blk.swap else plt.dot(xt, wt, trans_b=True))

    acc = jax.lax.fori_loop(0, ksteps, body, jnp.zeros((bn, bm) if blk.swap else (bm, bn), F32))
    o_ref[...] = acc.T if blk.swap else acc


@functools.partial(jax.jit, static_argnames=("blk", "interpret", "quantize"))
def _matmul_pallas(x, w, codes, layer, *, blk: GemmBlock, interpret: bool, quantize: bool = False):
    M, K = x.shape
    _, N, _ = w.shape
    fp8 = codes is not None
    ksteps = K // blk.bk // blk.splits
    m_tiles = -(-M // blk.bm)
    grid = (m_tiles, N // blk.bn, blk.splits)
    anyspec = pl.BlockSpec(memory_space=pl.ANY)
    args = [layer, x, w] + ([codes] if fp8 else [])
    # the output is padded to whole M tiles: jax 0.11.2's Triton lowering does not mask a block that overhangs
    # the array, so an overhanging store would write past the rows (into the next split's partials)
    out = pl.pallas_call(
        functools.partial(_mm_kernel, blk=blk, ksteps=ksteps, fp8=fp8, m_rows=M, interpret=interpret,
                          quantize=quantize),
        out_shape=jax.ShapeDtypeStruct((blk.splits, m_tiles * blk.bm, N), F32),
        grid=grid,
        in_specs=[anyspec] * len(args),
        out_specs=pl.BlockSpec((None, blk.bm, blk.bn), lambda i, j, s: (s, i, j)),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=blk.num_stages),
        interpret=interpret,
        name="gemm_fp8" if fp8 else "gemm_bf16",
    )(*args)
    return (out[0] if blk.splits == 1 else jnp.sum(out, axis=0))[:M]


def check_block(blk: GemmBlock, N: int, K: int, fp8: bool):
    if blk.decode == "fp8":
        if not fp8:
            raise ValueError(f"block {blk}: decode 'fp8' needs FP8 weights")
        return check_fp8_tiles(blk.bm, blk.nb, blk.bn, blk.bk, N, K, blk.splits, f"block {blk}")
    lo = 32 if fp8 else 16
    for name, v in (("bm", blk.bm), ("bn", blk.bn), ("bk", blk.bk)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two >= 16")
    if blk.bn < lo or blk.bk < lo or N % blk.bn or K % blk.bk or (K // blk.bk) % blk.splits:
        raise ValueError(f"block {blk} does not tile N={N}, K={K} (fp8={fp8})")
    if blk.decode not in DECODES:
        raise ValueError(f"block {blk}: decode must be one of {DECODES}")


def matmul(x, w, *, scale=None, layer=None, x_scale=None, quantize_x: bool = False, implementation: str = "pallas",
           interpret=None, block: GemmBlock | None = None):
    """y [M, N] f32 = x [M, K] @ dequant(w)^T; see the module docstring. quantize_x: x (bf16 / f32) goes onto the
    FP8 activation grid first (pallas_kernels/act_quant.py), inside the kernel as it is loaded."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}")
    if quantize_x and x_scale is not None:
        raise ValueError("x comes either quantized (x_scale) or to be quantized (quantize_x), not both")
    stacked = w.ndim == 3
    layer_arr = layer_array(layer, stacked)
    fp8 = scale is not None
    if fp8 and w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"FP8 weights must be float8_e4m3fn, got {w.dtype}")
    if not fp8 and w.dtype != BF16:
        raise ValueError(f"weights without scale must be bf16, got {w.dtype}")
    if implementation == "xla":
        return ref_matmul(x, w, scale=scale, layer=layer, x_scale=x_scale, quantize_x=quantize_x)
    M, K = x.shape
    if quantize_x and K % 32:
        raise ValueError(f"quantize_x needs K % 32 == 0, got x {x.shape}")
    if x_scale is not None and (x_scale.shape != (M, K // 32) or K % 32):
        raise ValueError(f"x {x.shape} needs x_scale [M, K/32], got {x_scale.shape}")
    if w.shape[-1] != K:
        raise ValueError(f"x {x.shape} and w {w.shape} disagree on K")
    N = w.shape[-2]
    w3 = w if stacked else w[None]
    codes = None
    if fp8:
        codes = scale_codes(scale)
        codes = codes if stacked else codes[None]
        if codes.shape[-2:] != (N // 32, K // 32) or N % 32 or K % 32:
            raise ValueError(f"FP8 weight {w.shape} needs N, K multiples of 32 and scale [.., N/32, K/32]")
    check_offsets(w3, *([codes] if fp8 else []))
    blk = block or pick_gemm_block(M, N, K, fp8=fp8, x_fp8=x_scale is not None or quantize_x)
    check_block(blk, N, K, fp8)
    if quantize_x and blk.bk % 32:
        raise ValueError(f"block {blk}: quantize_x needs bk % 32 == 0 (whole scale blocks per k step)")
    interpret = interpret_default() if interpret is None else interpret
    if blk.decode == "fp8":
        if quantize_x:
            return matmul_fp8(x, None, w3, codes, layer_arr, blk=blk, interpret=interpret)
        if x_scale is None:
            raise ValueError("decode 'fp8' needs x as E4M3 codes with x_scale, or quantize_x")
        xq, sx = x_codes_f32_scale(x, x_scale)
        return matmul_fp8(xq, sx, w3, codes, layer_arr, blk=blk, interpret=interpret)
    if x_scale is not None:
        x = dequant_x(x, x_scale)
    x = x if quantize_x else x.astype(BF16)  # quantize_x: the kernel rounds x onto the grid (from f32 if given)
    return _matmul_pallas(x, w3, codes, layer_arr, blk=blk, interpret=interpret, quantize=quantize_x)


# ----------------------------------------------------------------------------- f32 activations, bf16 weights
def matmul_f32x(x, w, *, interpret=None, block: GemmBlock | None = None):
    """y [M, N] f32 = x [M, K] f32 @ w [N, K] bf16 ^T with every product exact, reading w once: x's three bf16
    terms (split_bf16x3) are stacked as 3M rows of one bf16 GEMM (products bf16 x bf16, exact in f32; f32
    accumulation) and their rows summed in f32. The LM head: the checkpoint stores it in bf16 and the reference
    computes in f32 (dsv41_jax.ops.lm_head), so this reads half the bytes of an f32 GEMM and differs from
    x @ f32(w)^T only in the summation order (|y - ref| <= ~1e-5 * sum_k |x_k w_k|, tests/kernels)."""
    if w.dtype != BF16 or w.ndim != 2 or x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul_f32x: x [M, K] and w [N, K] bf16, got x {x.shape} w {w.shape} {w.dtype}")
    M = x.shape[0]
    y = matmul(jnp.concatenate(split_bf16x3(x), axis=0), w, interpret=interpret, block=block)
    return (y[:M] + y[M:2 * M]) + y[2 * M:]
