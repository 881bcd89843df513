"""FP8 x FP8 weight GEMMs with per-block scales: the pieces shared by pallas_kernels/gemm/fp8_kernel.py (FP8
block-32 linears) and pallas_kernels/moe/fp8_kernel.py (MXFP4 experts decoded to E4M3).

Both operands are E4M3 codes with power-of-two scales per 32-wide k block: x[r, k] = xq[r, k] * sx[r, k / 32] (the
model's activations are FP8 with a UE8M0 scale per 32 already: dsv41_jax.layers.act_qdq), w[n, k] = wq[n, k] *
sw[n, k / 32]. A dot over a k range spanning `nb` blocks keeps every block's sum apart by expanding the x tile
block-diagonally (R rows -> R * nb rows):

    A[(r, b), c] = xq[r, c] if block(c) == b else 0          (`block_diag`)
    P = A . Wq^T                                             [(r, b), n]: block b's sum of row r, exactly
    acc += P * sx[r, b] * sw[n, b]                           (`scale_grid`)
    y[r, n] = sum_b acc[(r, b), n]                           (`fold`, once at the end)

so the tensor core sees plain FP8 tiles (no per-element scale work: the scale costs R * nb * bn multiplies per
bn * 32 * nb weights), and the rows of the MMA that small-M GEMMs would pad with zeros carry the blocks instead.
R * nb is the MMA's row count (16, 32 or 64). With `swap` the weight tile is the dot's first operand ([bn, k] x
[k, R * nb], so bn can fill a 64-row wgmma) and acc, P, the scales are transposed.

Numerics: every product of two E4M3 codes is exact. By default (`fast_accum` False) Pallas emits the FP8 dot
with f32 accumulation, which Triton on Hopper runs as mma.sync on operands promoted to f16 (exact; one convert per
element), so the result is exact products summed in f32 like the bf16 kernels. `fast_accum` asks for
lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM, lowered here (`install_fast_accum_dot`) as a Triton dot with
max_num_imprecise_acc = K: Triton may then use a native FP8 wgmma (64-row tiles: swap with bn >= 64, or R * nb
= 64), which accumulates each block's <= 32 nonzero products with Hopper's reduced-precision FP8 accumulator
(about 14 mantissa bits) before the f32 `acc`: stated error 2^-9 * sum_k |x_k w_k| for those blocks
(bench/weight_gemms.py reports each variant's error against the reference on the GPU).
Scale codes: 2^(code - 127 + offset) by exponent bits, codes 1..254 - offset (code 0 reads as 0, not 2^-127).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn


def pow2(codes, offset: int = 0):
    """f32 2^(code - 127 + offset) of UE8M0 codes (any int dtype) by exponent bits."""
    return jax.lax.bitcast_convert_type((codes.astype(jnp.int32) + offset) << 23, F32)


def block_diag(xt, nb: int, cols_per_block: int):
    """uint8 x tile [R, nb * cols_per_block] -> E4M3 [R * nb, nb * cols_per_block]: row (r, b) keeps the
    columns of block b of row r, zeros elsewhere (nb = 1: the tile itself)."""
    if nb > 1:
        R, C = xt.shape
        xb = jnp.broadcast_to(xt[:, None, :], (R, nb, C))
        col_blk = jax.lax.broadcasted_iota(jnp.int32, (R, nb, C), 2) >> (cols_per_block.bit_length() - 1)
        row_blk = jax.lax.broadcasted_iota(jnp.int32, (R, nb, C), 1)
        xt = jnp.where(col_blk == row_blk, xb, jnp.zeros_like(xb)).reshape(R * nb, C)
    return jax.lax.bitcast_convert_type(xt, E4M3)


FAST_ACCUM = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM


def dot(a, w, swap: bool, fast_accum: bool = False):
    """P = A . W^T ([(r, b), n]) or, swapped, W . A^T ([n, (r, b)]); f32 (fast_accum: see the module docstring;
    compiled kernels only)."""
    from jax.experimental.pallas import triton as plt

    prec = FAST_ACCUM if fast_accum else None
    return plt.dot(w, a, trans_b=True, precision=prec) if swap else plt.dot(a, w, trans_b=True, precision=prec)


def install_fast_accum_dot() -> bool:
    """Teach jax's Pallas Triton lowering the FP8 FAST_ACCUM dot (which it rejects today): both operands FP8 ->
    tt.dot with max_num_imprecise_acc = K and an f32 result. Every other dot lowers as before. Process-wide,
    idempotent; False (and FAST_ACCUM dots keep failing to lower) if jax's internals moved."""
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as tl

        rules, tt, zeros = tl.triton_lowering_rules, tl.tt_dialect, tl._zeros
    except (ImportError, AttributeError):
        return False
    base = rules.get(jax.lax.dot_general_p)
    if base is None or getattr(base, "fast_accum_fp8", False):
        return base is not None

    def rule(ctx, a, b, *, dimension_numbers, precision, preferred_element_type, **kw):
        if precision != FAST_ACCUM:
            return base(ctx, a, b, dimension_numbers=dimension_numbers, precision=precision,
                        preferred_element_type=preferred_element_type, **kw)
        if any(jnp.dtype(v.dtype) not in (jnp.dtype(E4M3), jnp.dtype(jnp.float8_e5m2)) for v in ctx.avals_in):
            raise TypeError("FAST_ACCUM dots take FP8 operands")
        ((ca,), (cb,)), _ = dimension_numbers
        a = tt.trans(a, (1, 0)) if ca == 0 else a
        b = tt.trans(b, (1, 0)) if cb == 1 else b
        m, k = ir.RankedTensorType(a.type).shape
        n = ir.RankedTensorType(b.type).shape[1]
        acc = zeros(ir.RankedTensorType.get([m, n], ir.F32Type.get()))
        return tt.dot(a, b, acc, max_num_imprecise_acc=k)

    rule.fast_accum_fp8 = True
    rules[jax.lax.dot_general_p] = rule
    return True


FAST_ACCUM_LOWERING = install_fast_accum_dot()


def scale_grid(sx, sw, swap: bool):
    """sx [R, nb] f32, sw [bn, nb] f32 -> the multiplier of P: [(r, b), n] = sx[r, b] * sw[n, b] (swapped:
    [n, (r, b)])."""
    R, nb = sx.shape
    bn = sw.shape[0]
    if swap:
        return (sw[:, None, :] * sx[None, :, :]).reshape(bn, R * nb)
    return (sx[:, :, None] * jnp.transpose(sw)[None, :, :]).reshape(R * nb, bn)


def fold(acc, R: int, nb: int, swap: bool):
    """acc [(r, b), n] -> y [R, n] (swapped: [n, (r, b)] -> [n, R]): the sum over the blocks."""
    if nb == 1:
        return acc
    if swap:
        return jnp.sum(acc.reshape(acc.shape[0], R, nb), axis=2)
    return jnp.sum(acc.reshape(R, nb, acc.shape[1]), axis=1)


def expand_rows(s, rows_per: int):
    """[a, c] -> [a * rows_per, c] (each row repeated; broadcast + reshape, Triton-lowerable)."""
    a, c = s.shape
    return jnp.broadcast_to(s[:, None, :], (a, rows_per, c)).reshape(a * rows_per, c)


def check_fp8_tiles(bm: int, nb: int, bn: int, bk: int, N: int, K: int, splits: int, what: str):
    """The invariants of an FP8-dot block (both kernels): R = bm rows, nb blocks per dot, R * nb in (16, 32, 64),
    bk a multiple of 32 * nb, bk * splits | K, bn | N, powers of two."""
    for name, v in (("bm", bm), ("nb", nb), ("bn", bn), ("bk", bk)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{what}: {name}={v} must be a power of two")
    if bm * nb not in (16, 32, 64) or bn < 16 or bk % (32 * nb) or K % (bk * splits) or N % bn:
        raise ValueError(f"{what}: bm*nb must be 16/32/64, bn >= 16 | N={N}, 32*nb | bk, bk*splits | K={K}")
