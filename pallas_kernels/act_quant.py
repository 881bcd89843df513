"""The model's FP8 activation quantisation (E4M3 values, a UE8M0 scale per 32 along the last axis): one definition
that runs in XLA (dsv41_jax.quant.fp8_encode) and inside the GEMM kernels' prologues (pallas_kernels/gemm,
pallas_kernels/moe with `quantize_x`), so a linear's input is quantised where it is read instead of by two XLA
kernels (an amax reduction, then the codes) and a third that turns the scale codes into multipliers.

Rule (the reference's act_quant): amax = max(|x|) over the block, clamped to 1e-4; scale = 2^ceil(log2(amax / 448))
from the float bits (the UE8M0 code: exponent + (mantissa != 0)); values = clip(x / scale, +-448) rounded to E4M3
(nearest even). The clamp keeps the code in 105..254, so the scale is a normal f32 made from the code's bits.

Everything is plain jnp on f32 arrays (abs, max over the last axis, bit casts, shifts, a divide by a power of two,
a clip, a convert), which both XLA and the Pallas Triton lowering compile; the kernels reshape an [R, 32 nb] tile
to [R, nb, 32] blocks. Equality of the in-kernel and XLA paths: tests/kernels/test_act_quant.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
BLOCK = 32


def ue8m0_code(ratio):
    """Code (int32) of the smallest power of two >= ratio (ratio > 0, normal f32): exponent + (mantissa != 0)."""
    bits = jax.lax.bitcast_convert_type(ratio.astype(F32), jnp.int32)
    return ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def block_scale(amax):
    """Per-block max |x| -> (UE8M0 codes int32, f32 scales 2^(code - 127))."""
    code = ue8m0_code(jnp.maximum(amax, AMAX_FLOOR) * jnp.float32(1.0 / FP8_MAX))
    return code, jax.lax.bitcast_convert_type(code << 23, F32)


def to_e4m3(b, scale):
    """f32 blocks [..., c] and their scales [...] -> E4M3 values of b / scale (saturating, nearest even)."""
    return jnp.clip(b / scale[..., None], -FP8_MAX, FP8_MAX).astype(E4M3)


def encode_blocks(b):
    """f32 blocks [..., 32] -> (E4M3 values [..., 32], UE8M0 codes int32 [...], f32 scales 2^(code - 127) [...])."""
    code, scale = block_scale(jnp.max(jnp.abs(b), axis=-1))
    return to_e4m3(b, scale), code, scale


def _u8(q, shape):
    return jax.lax.bitcast_convert_type(q.reshape(shape), jnp.uint8)


def quantize_tile(xt):
    """An x tile [R, 32 nb] (any float) -> (uint8 E4M3 codes [R, 32 nb], f32 block multipliers [R, nb]): what the
    FP8 x FP8 kernels read (pallas_kernels/fp8dot.py)."""
    R, C = xt.shape
    q, _, scale = encode_blocks(xt.astype(F32).reshape(R, C // BLOCK, BLOCK))
    return _u8(q, (R, C)), scale


def qdq_tile(xt, dtype):
    """An x tile [R, 32 nb] -> its FP8 values (E4M3 * scale, exact in bf16) as `dtype`, for the kernels that
    multiply bf16 operands."""
    R, C = xt.shape
    q, _, scale = encode_blocks(xt.astype(F32).reshape(R, C // BLOCK, BLOCK))
    return (q.astype(F32) * scale[..., None]).reshape(R, C).astype(dtype)


def _plane_blocks(lo, hi):
    """Two planes [R, 16 nb] whose columns 16 b .. 16 b + 15 together hold block b (the MXFP4 kernels' even / odd
    or decoded-plane orders) -> (lo, hi) as f32 [R, nb, 16] and the blocks' scales [R, nb]."""
    R, C = lo.shape
    bl, bh = (p.astype(F32).reshape(R, C // 16, 16) for p in (lo, hi))
    _, scale = block_scale(jnp.maximum(jnp.max(jnp.abs(bl), axis=-1), jnp.max(jnp.abs(bh), axis=-1)))
    return bl, bh, scale


def quantize_planes(lo, hi):
    """(lo, hi) planes [R, 16 nb] -> (uint8 E4M3 codes of each, f32 block multipliers [R, nb])."""
    bl, bh, scale = _plane_blocks(lo, hi)
    return _u8(to_e4m3(bl, scale), lo.shape), _u8(to_e4m3(bh, scale), hi.shape), scale


def qdq_planes(lo, hi, dtype):
    """(lo, hi) planes [R, 16 nb] -> their FP8 values as `dtype` (exact in bf16)."""
    bl, bh, scale = _plane_blocks(lo, hi)
    return tuple((to_e4m3(b, scale).astype(F32) * scale[..., None]).reshape(p.shape).astype(dtype)
                 for b, p in ((bl, lo), (bh, hi)))
