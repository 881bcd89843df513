"""FP8 / FP4 formats of V4.1, bit-exact with the official kernels (docs/ARCHITECTURE.md, "Numerics").

Quantize-dequantize ("qdq", the reference's QAT semantics) along the last axis in blocks:
- ``fp8_qdq(x, 32)``: E4M3 values, UE8M0 (power-of-two) scale per 32; SWA KV and activations.
- ``fp4_qdq(x, 16, "e4m3")``: E2M1 values, E4M3 scale per 16; the global (compressed) KV latents.
- ``fp4_qdq(x, 32, "ue8m0")``: E2M1 values, UE8M0 scale per 32; index keys and index queries.

Rounding rules (as the reference): UE8M0 scale = 2^ceil(log2(amax * 1/qmax)) from the float bits;
amax clamps 1e-4 (fp8), 6*2^-126 (fp4/ue8m0), 6*2^-9 (fp4/e4m3); E4M3 round-to-nearest-even with
saturation at 448; E2M1 nearest on {0,.5,1,1.5,2,3,4,6} with ties to the even code.

Gradients: `fp8_qdq` and `fp4_qdq` are straight-through (a custom JVP whose tangent is the identity), so
quantization-aware training differentiates through every qdq point; their forward values are unchanged.

On-device byte formats (`fp4_pack` / `fp8_pack`): two E2M1 codes per byte, low nibble = even element;
scales as raw E4M3 / E8M0 bytes. Weight formats of the official checkpoint: FP8 E4M3 with one E8M0 scale
per 32x32 block, and MXFP4 routed experts (packed E2M1, E8M0 per 32 along the input dimension).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.act_quant import FP8_MAX, encode_blocks, ue8m0_code  # noqa: F401  (the FP8 rule lives there)

F32 = jnp.float32
FP4_MAX = 6.0
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
_FP4_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------- scales
def e8m0_code_to_f32(code):
    """2^(code-127) as f32 (code 0 -> 2^-127, a subnormal)."""
    code = code.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(code << 23, F32)
    return jnp.where(code == 0, jnp.float32(2.0 ** -127), normal)


def e8m0_to_f32(scale):
    """Decode an E8M0 scale array (dtype float8_e8m0fnu or raw uint8 codes) to f32."""
    if scale.dtype != jnp.uint8:
        scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
    return e8m0_code_to_f32(scale)


def _blocks(x, block):
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} not a multiple of block {block}")
    return x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


# ----------------------------------------------------------------------------- FP8
def fp8_encode(x, block: int = 32):
    """-> (E4M3 values [..., n] float8_e4m3fn, UE8M0 scale codes [..., n/block] uint8); the rule:
    pallas_kernels/act_quant.py (shared with the GEMM kernels' prologues)."""
    q, code, _ = encode_blocks(_blocks(x, block))
    return q.reshape(x.shape), code.astype(jnp.uint8)


def fp8_decode(q, codes, block: int = 32, dtype=F32):
    b = q.astype(F32).reshape(*q.shape[:-1], q.shape[-1] // block, block)
    return (b * e8m0_code_to_f32(codes)[..., None]).reshape(q.shape).astype(dtype)


def fp8_qdq(x, block: int = 32):
    """E4M3 values with a UE8M0 scale per `block`, dequantized to x.dtype; straight-through gradient."""
    return _fp8_qdq_ste(x, block)


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def _fp8_qdq_ste(x, block):
    q, codes = fp8_encode(x, block)
    return fp8_decode(q, codes, block, x.dtype)


@_fp8_qdq_ste.defjvp
def _fp8_qdq_jvp(block, primals, tangents):
    return _fp8_qdq_ste(primals[0], block), tangents[0]


def fp8_pack(x, block: int = 32):
    """Byte layout of an FP8 cache entry: (E4M3 bytes uint8 [..., n], UE8M0 bytes uint8 [..., n/block])."""
    q, codes = fp8_encode(x, block)
    return jax.lax.bitcast_convert_type(q, jnp.uint8), codes


def fp8_unpack(qbytes, codes, block: int = 32, dtype=F32):
    return fp8_decode(jax.lax.bitcast_convert_type(qbytes, jnp.float8_e4m3fn), codes, block, dtype)


# ----------------------------------------------------------------------------- FP4 (E2M1)
def fp4_codes(y):
    """E2M1 codes (uint8, sign in bit 3) of y (already scaled into [-6, 6]); nearest, ties to even code."""
    v = jnp.minimum(jnp.abs(y), FP4_MAX)
    idx = jnp.zeros(v.shape, jnp.int32)
    for k, m in enumerate(_FP4_MID):
        idx = idx + (v > m).astype(jnp.int32)
        if k % 2 == 1:  # a tie at an odd code's upper midpoint rounds up to the even code
            idx = idx + (v == m).astype(jnp.int32)
    sign = jnp.signbit(y).astype(jnp.int32) << 3
    return (idx | sign).astype(jnp.uint8)


def fp4_code_values(codes):
    return jnp.asarray(FP4_VALUES)[codes.astype(jnp.int32)]


def _fp4_scale(amax, fmt: str):
    """-> (f32 scale, raw scale byte uint8)."""
    if fmt == "e4m3":
        s8 = (jnp.maximum(amax, 6 * 2.0 ** -9) / FP4_MAX).astype(jnp.float8_e4m3fn)
        return s8.astype(F32), jax.lax.bitcast_convert_type(s8, jnp.uint8)
    if fmt == "ue8m0":
        code = ue8m0_code(jnp.maximum(amax, 6 * 2.0 ** -126) * jnp.float32(1.0 / FP4_MAX))
        return e8m0_code_to_f32(code), code.astype(jnp.uint8)
    raise ValueError(f"unknown FP4 scale format {fmt!r}")


def fp4_encode(x, block: int, fmt: str):
    """-> (codes uint8 [..., n] one E2M1 code per element, scale bytes uint8 [..., n/block])."""
    b = _blocks(x, block)
    scale, sbytes = _fp4_scale(jnp.max(jnp.abs(b), axis=-1), fmt)
    codes = fp4_codes(jnp.clip(b / scale[..., None], -FP4_MAX, FP4_MAX))
    return codes.reshape(x.shape), sbytes


def fp4_scale_bytes_to_f32(sbytes, fmt: str):
    if fmt == "e4m3":
        return jax.lax.bitcast_convert_type(sbytes.astype(jnp.uint8), jnp.float8_e4m3fn).astype(F32)
    return e8m0_code_to_f32(sbytes)


def fp4_decode_codes(codes, sbytes, block: int, fmt: str, dtype=F32):
    v = fp4_code_values(codes).reshape(*codes.shape[:-1], codes.shape[-1] // block, block)
    return (v * fp4_scale_bytes_to_f32(sbytes, fmt)[..., None]).reshape(codes.shape).astype(dtype)


def fp4_qdq(x, block: int, fmt: str):
    """E2M1 values with a `fmt` scale per `block`, dequantized to x.dtype; straight-through gradient."""
    return _fp4_qdq_ste(x, block, fmt)


@partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _fp4_qdq_ste(x, block, fmt):
    codes, sbytes = fp4_encode(x, block, fmt)
    return fp4_decode_codes(codes, sbytes, block, fmt, x.dtype)


@_fp4_qdq_ste.defjvp
def _fp4_qdq_jvp(block, fmt, primals, tangents):
    return _fp4_qdq_ste(primals[0], block, fmt), tangents[0]


def pack_nibbles(codes):
    """[..., n] 4-bit codes -> [..., n/2] bytes, low nibble = even element."""
    c = codes.astype(jnp.uint8)
    return (c[..., 0::2] & 15) | ((c[..., 1::2] & 15) << 4)


def unpack_nibbles(packed):
    p = packed.astype(jnp.uint8)
    return jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def fp4_pack(x, block: int, fmt: str):
    """Byte layout of an FP4 cache entry: (packed E2M1 uint8 [..., n/2], scale bytes uint8 [..., n/block])."""
    codes, sbytes = fp4_encode(x, block, fmt)
    return pack_nibbles(codes), sbytes


def fp4_unpack(packed, sbytes, block: int, fmt: str, dtype=F32):
    return fp4_decode_codes(unpack_nibbles(packed), sbytes, block, fmt, dtype)


# ----------------------------------------------------------------------------- weight formats
def quantize_weight_fp8(w, block: int = 32):
    """[..., out, in] -> (float8_e4m3fn [..., out, in], float8_e8m0fnu [..., ceil(out/b), ceil(in/b)]):
    one power-of-two scale per block x block tile, as the official checkpoint stores FP8 linears."""
    *lead, out, inp = w.shape
    po, pi = -out % block, -inp % block
    wf = jnp.pad(w.astype(F32), [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    t = wf.reshape(*lead, (out + po) // block, block, (inp + pi) // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(t), axis=(-3, -1)), 1e-4)
    code = ue8m0_code(amax * jnp.float32(1.0 / FP8_MAX))
    scale = e8m0_code_to_f32(code)
    q = jnp.clip(t / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    q = q.reshape(*lead, out + po, inp + pi)[..., :out, :inp]
    return q, jax.lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.float8_e8m0fnu)


def dequantize_weight_fp8(q, scale, dtype=jnp.bfloat16, block: int = 32):
    *lead, out, inp = q.shape
    s = e8m0_to_f32(scale)
    s = jnp.repeat(jnp.repeat(s, block, axis=-2), block, axis=-1)[..., :out, :inp]
    return (q.astype(F32) * s).astype(dtype)


def quantize_weight_fp4(w, block: int = 32):
    """MXFP4 expert weight [..., out, in] -> (packed uint8 [..., out, in/2], float8_e8m0fnu [..., out, in/32])."""
    packed, sbytes = fp4_pack(w, block, "ue8m0")
    return packed, jax.lax.bitcast_convert_type(sbytes, jnp.float8_e8m0fnu)


def dequantize_weight_fp4(packed, scale, dtype=jnp.bfloat16, block: int = 32):
    sb = jax.lax.bitcast_convert_type(scale, jnp.uint8) if scale.dtype != jnp.uint8 else scale
    return fp4_unpack(packed, sb, block, "ue8m0", dtype)
