"""The kernel weight layouts and the in-register decoders of pallas_kernels.fp_decode, on CPU:
official -> tiled -> official is bit-exact on random bytes (numpy and jnp alike), the tiled layout's nibble slots
are a permutation, and the GPU decoders' bit formulas (emulated here in numpy on uint32 words, with numpy's
subnormal-preserving floats) give exactly e2m1 / e4m3 * 2^bias for every code and byte."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.kernel_layout import to_official_mxfp4, to_tiled_mxfp4
from pallas_kernels import fp_decode
from pallas_kernels.common import e4m3_to_f32


@pytest.mark.parametrize("bk", [128, 256, 512])
def test_round_trip_bit_exact(bk):
    rng = np.random.default_rng(bk)
    p = rng.integers(0, 256, (3, 5, 1024), dtype=np.uint8)
    t = to_tiled_mxfp4(p, bk)
    assert t.shape == p.shape and t.dtype == np.uint8 and not np.array_equal(t, p)
    np.testing.assert_array_equal(to_official_mxfp4(t, bk), p)
    tj = to_tiled_mxfp4(jnp.asarray(p), bk)
    np.testing.assert_array_equal(np.asarray(tj), t)
    np.testing.assert_array_equal(np.asarray(to_official_mxfp4(tj, bk)), p)
    # a byte permutation of nibbles: each tile keeps its multiset of codes
    codes = lambda a: np.sort(np.stack([a & 15, a >> 4], -1).reshape(3, 5, -1, bk), axis=-1)  # noqa: E731
    np.testing.assert_array_equal(codes(t), codes(p))


def test_bad_layout_args():
    with pytest.raises(ValueError):
        to_tiled_mxfp4(np.zeros((4, 96), np.uint8), 256)  # K = 192 not a multiple of 256
    with pytest.raises(ValueError):
        to_tiled_mxfp4(np.zeros((4, 128), np.int8), 256)


def test_word_slots_are_permutations():
    for layout in ("official", "tiled"):
        s = fp_decode.word_nibble_k(256, layout).reshape(-1)
        np.testing.assert_array_equal(np.sort(s), np.arange(256))
    np.testing.assert_array_equal(fp_decode.official_k_order(16)[:8], [3, 7, 2, 6, 11, 15, 10, 14])


def _bf16_value(bits_u16):
    return bits_u16.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def test_fp4_bit_decode_all_words():
    """The asm's shifts/masks on random words: lane l of output register r = nibble WORD_LO/HI of the plane."""
    rng = np.random.default_rng(0)
    w = rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    w[:256] = np.arange(256, dtype=np.uint32) * 0x01010101  # every byte value
    nib = lambda q: ((w >> (4 * q)) & 15).astype(np.int64)  # noqa: E731
    for out, (sgn, mag) in enumerate(fp_decode._FP4_SHIFTS):
        shift = lambda v, s: (v << np.uint32(s)) if s > 0 else (v >> np.uint32(-s))  # noqa: E731
        r = (shift(w, mag) & np.uint32(0x01C001C0)) | (shift(w, sgn) & np.uint32(0x80008000))
        order = (fp_decode.WORD_LO, fp_decode.WORD_HI)[out // 2]
        for lane in range(2):
            got = _bf16_value((r >> np.uint32(16 * lane)) & np.uint32(0xFFFF))
            want = fp_decode.FP4_VALUES[nib(order[2 * (out % 2) + lane])] * 2.0 ** fp_decode.FP4_BIAS_LOG2
            np.testing.assert_array_equal(got, want)


def test_fp8_bit_decode_all_bytes():
    b = np.arange(256, dtype=np.uint32)
    t = b << np.uint32(8)  # prmt puts the byte in a lane's high byte
    r = ((t >> np.uint32(4)) & np.uint32(0x07F0)) | (t & np.uint32(0x8000))
    got = _bf16_value(r)
    want = np.asarray(e4m3_to_f32(jnp.asarray(b)), np.float64) * 2.0 ** fp_decode.FP8_BIAS_LOG2
    fin = (b & 127) != 127  # NaN bytes decode to finite values (documented)
    np.testing.assert_array_equal(got[fin], want[fin])


def test_scale_multipliers_exact_in_domain():
    c = jnp.arange(256)
    s4 = np.asarray(fp_decode.fp4_scale_bf16(c), np.float64)
    ok = (np.arange(256) >= 0) & (np.arange(256) <= 136)
    np.testing.assert_array_equal(s4[ok], 2.0 ** (np.arange(256)[ok] - 9.0))
    assert np.all(np.isinf(s4[137:]))
    s8 = np.asarray(fp_decode.fp8_scale_bf16(c), np.float64)
    np.testing.assert_array_equal(s8[:135], 2.0 ** (np.arange(135) - 7.0))
    assert np.all(np.isinf(s8[135:]))
