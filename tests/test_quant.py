"""FP8/FP4 formats: hand-computed bytes, independent brute-force references, round-trip bounds."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import quant

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def np_pow2_ceil(r):
    """Smallest power of two >= r, from exact rational math (r > 0)."""
    e = np.ceil(np.log2(r.astype(np.float64)))
    e = np.where(2.0 ** (e - 1) >= r, e - 1, e)  # guard log2 rounding
    e = np.where(2.0 ** e < r, e + 1, e)
    return 2.0 ** e


def np_fp4_nearest(y):
    """Brute force: nearest grid point, ties to the even code."""
    a = np.abs(y)[..., None]
    d = np.abs(a - GRID)
    best = d.min(-1, keepdims=True)
    cand = (d == best)
    # among ties prefer the even code index
    codes = np.where(cand & (np.arange(8) % 2 == 0), np.arange(8), 99).min(-1)
    codes = np.where(codes == 99, cand.argmax(-1), codes)
    return np.sign(y) * GRID[codes], codes


def test_e8m0_scale_rule():
    r = jnp.asarray([1.0, 1.5, 2.0, 0.75, 2.0 ** -20 * 1.01], jnp.float32)
    s = quant.e8m0_code_to_f32(quant.ue8m0_code(r))
    np.testing.assert_array_equal(np.asarray(s), [1.0, 2.0, 2.0, 1.0, 2.0 ** -19])
    assert int(quant.ue8m0_code(jnp.float32(1.0))) == 127


def test_fp8_hand_cases():
    # block amax 448*4 -> scale exactly 4 (code 129); x/4 are exact e4m3 values
    x = np.zeros(32, np.float32)
    x[:4] = [448 * 4, -8.0, 1.0, 0.0]
    x[4:] = 2.0
    q, codes = quant.fp8_pack(jnp.asarray(x))
    assert int(codes[0]) == 129
    np.testing.assert_array_equal(np.asarray(q)[:3], [0x7E, 0xC0, 0x28])  # 448, -2, 0.25 as e4m3 bytes
    np.testing.assert_array_equal(np.asarray(quant.fp8_unpack(q, codes)), x)
    # amax just above a power of two bumps the scale
    x2 = x.copy()
    x2[0] = 448 * 4 * 1.001
    assert int(quant.fp8_pack(jnp.asarray(x2))[1][0]) == 130


def test_fp8_matches_reference_rules_random():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 96)) * np.exp(rng.uniform(-6, 6, (64, 1)))).astype(np.float32)
    y = np.asarray(quant.fp8_qdq(jnp.asarray(x), 32))
    b = x.reshape(64, 3, 32)
    amax = np.maximum(np.abs(b).max(-1), 1e-4)
    s = np_pow2_ceil(amax.astype(np.float32) * np.float32(1 / 448))
    ref = (np.clip(b / s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s[..., None])
    np.testing.assert_array_equal(y, ref.reshape(64, 96))
    # round-trip bound: half an e4m3 ulp (relative 2^-4), or half the subnormal step
    err = np.abs(y - x).reshape(64, 3, 32)
    assert np.all(err <= np.maximum(np.abs(b) * 2 ** -4, s[..., None] * 2 ** -10) * (1 + 1e-6))


def test_fp4_ties_and_packing():
    # scale pinned to 1 by a 6.0 in the block (ue8m0: 6 * 1/6 = 1)
    y = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.5, -3.0, 0.0, 4.0] + [0.0] * 20, np.float32)
    codes, sb = quant.fp4_encode(jnp.asarray(y), 32, "ue8m0")
    assert int(sb[0]) == 127
    np.testing.assert_array_equal(np.asarray(codes)[:12], [0, 2, 2, 4, 4, 6, 6, 7, 9, 13, 0, 6])
    packed = np.asarray(quant.pack_nibbles(codes))
    assert packed[0] == 0x20 and packed[1] == 0x42 and packed[4] == 0xD9  # low nibble = even element
    np.testing.assert_array_equal(np.asarray(quant.unpack_nibbles(jnp.asarray(packed))), np.asarray(codes))
    # e4m3 scale: amax 6 -> 6/6 = 1.0 = byte 0x38
    assert int(quant.fp4_encode(jnp.asarray(y[:16]), 16, "e4m3")[1][0]) == 0x38


@pytest.mark.parametrize("block,fmt", [(16, "e4m3"), (32, "ue8m0")])
def test_fp4_matches_brute_force(block, fmt):
    rng = np.random.default_rng(block)
    x = (rng.standard_normal((32, 128)) * np.exp(rng.uniform(-5, 5, (32, 1)))).astype(np.float32)
    got = np.asarray(quant.fp4_qdq(jnp.asarray(x), block, fmt))
    b = x.reshape(32, -1, block)
    amax = np.abs(b).max(-1)
    if fmt == "e4m3":
        s = (np.maximum(amax, 6 * 2.0 ** -9) / 6).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    else:
        s = np_pow2_ceil(np.maximum(amax, 6 * 2.0 ** -126).astype(np.float32) * np.float32(1 / 6))
    yq, _ = np_fp4_nearest(np.clip(b / s[..., None], -6, 6))
    np.testing.assert_array_equal(got, (yq * s[..., None]).reshape(x.shape).astype(np.float32))
    # bound: at most half the grid step at the value's magnitude (+ the clip when an e4m3 scale rounds down)
    err = np.abs(got.reshape(b.shape) - b) / s[..., None]
    a = np.abs(b) / s[..., None]
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    assert np.all(err <= step / 2 + np.maximum(a - 6, 0) + 1e-6)


def test_fp4_pack_roundtrip_bytes():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 512)).astype(np.float32))
    packed, sb = quant.fp4_pack(x, 16, "e4m3")
    assert packed.shape == (4, 256) and sb.shape == (4, 32)  # 288 bytes per 512-d latent
    np.testing.assert_array_equal(np.asarray(quant.fp4_unpack(packed, sb, 16, "e4m3")),
                                  np.asarray(quant.fp4_qdq(x, 16, "e4m3")))


def test_official_checkpoint_bytes():
    """Decoding of real bytes sampled from the official checkpoint (public mlx-lm test fixture)."""
    w = np.frombuffer(bytes.fromhex("d871f2797069f0e55370eee3dcd8776d6bdc6bf25b66716b5c6d71d0eae7e062"),
                      np.uint8)[:32].reshape(1, 32)
    s = np.array([[0x73]], np.uint8)
    got = np.asarray(quant.dequantize_weight_fp8(jnp.asarray(w).view(jnp.float8_e4m3fn),
                                                 jnp.asarray(s).view(jnp.float8_e8m0fnu), jnp.float32))
    np.testing.assert_array_equal(got[0, :8], [-0.00390625, 0.03515625, -0.0390625, 0.0703125, 0.03125,
                                               0.017578125, -0.03125, -0.0126953125])
    p = np.frombuffer(bytes.fromhex("a0a8ec4aadaf42aacc82256ffa054544"), np.uint8).reshape(1, 16)
    sc = np.array([[0x78]], np.uint8)
    got = np.asarray(quant.dequantize_weight_fp4(jnp.asarray(p), jnp.asarray(sc).view(jnp.float8_e8m0fnu),
                                                 jnp.float32))
    np.testing.assert_array_equal(got[0, :16], [0.0, -0.0078125, 0.0, -0.0078125, -0.015625, -0.03125,
                                                -0.0078125, 0.015625, -0.0234375, -0.0078125, -0.046875,
                                                -0.0078125, 0.0078125, 0.015625, -0.0078125, -0.0078125])


def test_weight_quantizers_roundtrip():
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((2, 70, 96)).astype(np.float32) * 0.05)
    q, s = quant.quantize_weight_fp8(w)
    assert q.shape == (2, 70, 96) and s.shape == (2, 3, 3)
    dq = quant.dequantize_weight_fp8(q, s, jnp.float32)
    assert bool(jnp.all(jnp.abs(dq - w) <= jnp.abs(w) * 2 ** -4 + 1e-6))
    # re-quantizing an FP8-representable weight is lossless
    q2, s2 = quant.quantize_weight_fp8(dq)
    np.testing.assert_array_equal(np.asarray(quant.dequantize_weight_fp8(q2, s2, jnp.float32)), np.asarray(dq))
    pk, ps = quant.quantize_weight_fp4(w)
    assert pk.shape == (2, 70, 48) and ps.shape == (2, 70, 3)
    np.testing.assert_array_equal(np.asarray(quant.dequantize_weight_fp4(pk, ps, jnp.float32)),
                                  np.asarray(quant.fp4_qdq(w, 32, "ue8m0")))
