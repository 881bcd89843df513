"""In-register decoders of the official weight formats straight to scaled bf16, for the weight GEMM kernels.

Both decoders take a tile of weight bytes plus a bf16 tile holding each element's block scale (broadcast), and
return bf16 tiles with value = decoded weight * block scale, exactly (every product below is a power of two times a
value of <= 4 significant bits). On the GPU they are one `plt.elementwise_inline_asm` each, working on 32-bit
registers (4 bytes per instance); in interpret mode (CPU) they are plain jnp arithmetic (XLA:CPU flushes bf16/f32
subnormals, which the bit tricks below produce on purpose, so the CPU path decodes by value).

MXFP4 (E2M1, two codes per byte), `e2m1_planes`: a 32-bit word holds 8 codes (nibble q = bits 4q..4q+3). A nibble's
sign goes to bf16 bit 15 and its e1 e0 m bits to bf16 bits 8..6, so the bf16 value is e2m1 * 2^-126 for normal and
subnormal codes alike; a `fma.rn.bf16x2` by 2^(s-9) (scale code s) then gives w * 2^-8 = e2m1 * 2^(s-135) (the 2^-8
keeps every multiplier inside bf16's range for the codes real weights have; the kernel multiplies its f32 sums by
2^8). Two lanes per register, 4 shifts/masks + 1 fma per 2 values. The 8 nibbles of a word leave in two "planes" of
4 elements each: lo = nibbles WORD_LO = (3, 7, 2, 6), hi = nibbles WORD_HI = (1, 5, 0, 4), so the decoded tiles are
a fixed permutation of the weight's k order: the GEMM either permutes x's columns the same way (`official_k_order`,
the checkpoint's bytes as they are) or reads bytes re-laid out once so that the planes come out in k order
(`tiled_k_order`; checkpoints/kernel_layout.py converts).

FP8 (E4M3), `e4m3_scaled`: prmt spreads 2 bytes into the high bytes of two bf16 lanes; sign stays at bit 15 and
e3..e0 m2..m0 shift to bits 10..4: value = e4m3 * 2^-120 (subnormals too); fma by 2^(s-7).

MXFP4 to E4M3 codes, `e2m1_e4m3_planes` (the FP8-dot kernels, pallas_kernels/fp8dot.py): each nibble becomes an E4M3
byte in place (sign to bit 7, e1 e0 m to bits 4..2), value e2m1 * 2^-6 exactly (subnormal 0.5 too); lo = the low
nibbles (even k of the official layout), hi = the high nibbles (odd k). No scale is applied (the FP8-dot kernels
scale f32 block sums). One 32-bit word -> one word per plane: 2 shifts + 2 ands + 1 or (lo), 1 shift + 2 ands + 1 or
(hi), i.e. ~5 integer ops per 8 weights.

Scale domains (the UE8M0 code s of the block): MXFP4 is exact for 7 <= s <= 136 and FP8 for s <= 134; a larger code
gives inf (never silently a wrong finite value); MXFP4 codes below 7 (|w| < 2^-121) may flush to 0. E4M3 NaN bytes
(0x7f / 0xff) decode to finite values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import e2m1_to_f32

BF16, F32 = jnp.bfloat16, jnp.float32
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
WORD_LO = (3, 7, 2, 6)  # nibble of a 32-bit word -> element i of the lo plane's 4 elements
WORD_HI = (1, 5, 0, 4)
FP4_BIAS_LOG2 = -126  # decoded bf16 bits of a code = e2m1 * 2^FP4_BIAS_LOG2
FP8_BIAS_LOG2 = -120
FP4_ACC_LOG2 = 8  # MXFP4 tiles are decoded as w * 2^-8 (the dot's f32 result is multiplied back by 2^8)

# per output register: (shift of the sign bits to bit 15/31, shift of e1 e0 m to bits 8..6 / 24..22); >0 is left
_FP4_SHIFTS = ((0, -6), (4, -2), (8, 2), (12, 6))  # lo 0/1, lo 2/3, hi 0/1, hi 2/3 (nibbles 3/7, 2/6, 1/5, 0/4)


def _sh(reg: str, s: int) -> str:
    return f"shl.b32 rt, {reg}, {s};" if s > 0 else (f"shr.b32 rt, {reg}, {-s};" if s < 0 else f"mov.b32 rt, {reg};")


def _fp4_asm(plane: int) -> str:
    """One plane (0: lo, 1: hi): outputs $0 $1 (2 x bf16x2), inputs $2 (4 packed bytes), $3 $4 (bf16x2 scales).
    (One asm per plane: Pallas' lowering of a multi-result elementwise_inline_asm drops all but one result.)"""
    lines = ["{", ".reg .b32 rt, ru, rz;", "mov.b32 rz, 0x80008000;"]
    for out, (sgn, mag) in enumerate(_FP4_SHIFTS[2 * plane: 2 * plane + 2]):
        lines += [_sh("$2", mag).replace("rt", "ru"), "and.b32 ru, ru, 0x01C001C0;",
                  _sh("$2", sgn), "and.b32 rt, rt, 0x80008000;", "or.b32 ru, ru, rt;",
                  f"fma.rn.bf16x2 ${out}, ru, ${3 + out}, rz;"]
    return "\n".join(lines + ["}"])


FP4_ASM = (_fp4_asm(0), _fp4_asm(1))

# outputs $0 $1 (bf16x2 of bytes 0,1 / 2,3), inputs $2 (4 e4m3 bytes), $3 $4 (bf16x2 scales)
FP8_ASM = "\n".join([
    "{", ".reg .b32 rt, ru, rz, r0;", "mov.b32 rz, 0x80008000;", "mov.b32 r0, 0;",
    "prmt.b32 rt, $2, r0, 0x1404;", "shr.b32 ru, rt, 4;", "and.b32 ru, ru, 0x07F007F0;",
    "and.b32 rt, rt, 0x80008000;", "or.b32 ru, ru, rt;", "fma.rn.bf16x2 $0, ru, $3, rz;",
    "prmt.b32 rt, $2, r0, 0x3424;", "shr.b32 ru, rt, 4;", "and.b32 ru, ru, 0x07F007F0;",
    "and.b32 rt, rt, 0x80008000;", "or.b32 ru, ru, rt;", "fma.rn.bf16x2 $1, ru, $4, rz;",
    "}"])


# lo / hi plane of E4M3 bytes from 4 packed E2M1 bytes: $0 out, $1 in
E4M3_ASM = ("{ .reg .b32 rt, ru; shl.b32 rt, $1, 2; and.b32 rt, rt, 0x1C1C1C1C; shl.b32 ru, $1, 4; "
            "and.b32 ru, ru, 0x80808080; or.b32 $0, rt, ru; }",
            "{ .reg .b32 rt, ru; shr.b32 rt, $1, 2; and.b32 rt, rt, 0x1C1C1C1C; and.b32 ru, $1, 0x80808080; "
            "or.b32 $0, rt, ru; }")
E4M3_FROM_E2M1_LOG2 = -6  # an E4M3 byte of `e2m1_e4m3_planes` holds e2m1 * 2^-6


# ----------------------------------------------------------------------------- scales
def pow2_bf16(codes, offset: int):
    """bf16 2^(code + offset) of UE8M0 codes (int array); inf where that overflows (exact powers otherwise)."""
    e = jnp.clip(codes.astype(jnp.int32) + offset + 127, 0, 255)
    return jax.lax.bitcast_convert_type(e << 23, F32).astype(BF16)


def fp4_scale_bf16(codes):
    """Per-block multiplier of `e2m1_planes`: 2^(s - 127 - FP4_BIAS_LOG2 - FP4_ACC_LOG2) = 2^(s - 9), so the
    decoded tile is w * 2^-8, exact for codes 7..136 (|w| in [2^-121, 3072]; bf16 tops out at 2^127)."""
    return pow2_bf16(codes, -127 - FP4_BIAS_LOG2 - FP4_ACC_LOG2)


def fp8_scale_bf16(codes):
    """Per-block multiplier of `e4m3_scaled`: 2^(s - 7)."""
    return pow2_bf16(codes, -127 - FP8_BIAS_LOG2)


# ----------------------------------------------------------------------------- decoders
def _plane_codes(b, order):
    """uint8 tile [r, c] -> int32 codes [r, c] of one plane: element 4t+i is nibble order[i] of word t."""
    r, c = b.shape
    w = b.astype(jnp.int32).reshape(r, c // 4, 4)
    cols = [(w[:, :, q // 2] >> (4 * (q % 2))) & 15 for q in order]
    return jnp.stack(cols, axis=-1).reshape(r, c)


def e2m1_planes(b, s_lo, s_hi, *, interpret: bool):
    """Packed E2M1 bytes [r, c] uint8 and bf16 scale tiles [r, c] (`fp4_scale_bf16`, each equal within runs of 4
    columns) -> (lo, hi) bf16 [r, c]: lo[:, 4t+i] = code WORD_LO[i] of word t times s_lo, hi likewise."""
    if interpret:
        return tuple((e2m1_to_f32(_plane_codes(b, order)) * (s.astype(F32) * jnp.float32(2.0 ** FP4_BIAS_LOG2))
                      ).astype(BF16) for order, s in ((WORD_LO, s_lo), (WORD_HI, s_hi)))
    from jax.experimental.pallas import triton as plt

    sd = [jax.ShapeDtypeStruct(b.shape, BF16)]
    return tuple(plt.elementwise_inline_asm(asm, args=[b, s], constraints="=r,=r,r,r,r", pack=4,
                                            result_shape_dtypes=sd)[0] for asm, s in zip(FP4_ASM, (s_lo, s_hi)))


def e2m1_e4m3_planes(b, *, interpret: bool):
    """Packed E2M1 bytes [r, c] uint8 -> (lo, hi) bytes [r, c] holding E4M3 codes of e2m1 * 2^-6 (bitcast them to
    float8_e4m3fn): lo[:, j] = the low nibble of byte j (k = 2j in the official layout), hi[:, j] = the high nibble
    (k = 2j + 1). Compiled, the bytes are int8 (Triton's inline asm takes signless integers only)."""
    if interpret:
        return ((b & 7) << 2) | ((b & 8) << 4), ((b >> 2) & 0x1C) | (b & 0x80)
    from jax.experimental.pallas import triton as plt

    sd = [jax.ShapeDtypeStruct(b.shape, jnp.int8)]
    return tuple(plt.elementwise_inline_asm(asm, args=[b], constraints="=r,r", pack=4, result_shape_dtypes=sd)[0]
                 for asm in E4M3_ASM)


def e4m3_scaled(q, scale, *, interpret: bool):
    """E4M3 tile [r, c] (float8_e4m3fn) and a bf16 scale tile (`fp8_scale_bf16`) -> bf16 q * 2^-120 * scale."""
    if interpret:
        return (q.astype(F32) * (scale.astype(F32) * jnp.float32(2.0 ** FP8_BIAS_LOG2))).astype(BF16)
    from jax.experimental.pallas import triton as plt

    [y] = plt.elementwise_inline_asm(FP8_ASM, args=[q, scale], constraints="=r,=r,r,r,r", pack=4,
                                     result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, BF16)])
    return y


# ----------------------------------------------------------------------------- k orders of the decoded planes
def official_k_order(bk: int) -> np.ndarray:
    """Checkpoint bytes (low nibble = even k): the k (within a tile of bk values) of each column of the
    concatenated (lo | hi) planes of the tile's bk/2 bytes."""
    t = np.arange(bk // 8)[:, None] * 8
    return np.concatenate([(t + np.asarray(WORD_LO)).reshape(-1), (t + np.asarray(WORD_HI)).reshape(-1)])


def tiled_k_order(bk: int) -> np.ndarray:
    """The tiled layout: lo plane = the tile's first bk/2 k values in order, hi plane = the last bk/2."""
    return np.arange(bk)


def word_nibble_k(bk: int, layout: str) -> np.ndarray:
    """[bk/8, 8]: the k (within the tile) stored in nibble q of word t of a tile, for `layout`."""
    cols = official_k_order(bk) if layout == "official" else tiled_k_order(bk)
    lo, hi = cols[:bk // 2].reshape(-1, 4), cols[bk // 2:].reshape(-1, 4)
    out = np.empty((bk // 8, 8), np.int64)
    out[:, list(WORD_LO)] = lo
    out[:, list(WORD_HI)] = hi
    return out
