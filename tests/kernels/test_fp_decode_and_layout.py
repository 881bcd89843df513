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


def _ptx_run(asm: str, word):
    """A tiny emulator of the integer PTX the E4M3 plane decoders use (mov / shl / shr / and / or on b32), on a
    numpy uint32 array bound to $1; returns $0."""
    regs = {"$1": word.astype(np.uint32)}
    val = lambda t: regs[t] if t in regs else np.uint32(int(t, 0))  # noqa: E731
    for ins in asm.strip("{} ").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        a = val(src[0])
        regs[d] = {"mov.b32": lambda: a, "shl.b32": lambda: a << val(src[1]), "shr.b32": lambda: a >> val(src[1]),
                   "and.b32": lambda: a & val(src[1]), "or.b32": lambda: a | val(src[1])}[op]().astype(np.uint32)
    return regs["$0"]


def test_e4m3_planes_all_bytes():
    """fp_decode.e2m1_e4m3_planes (interpret path) and its two PTX programs (emulated on 32-bit words holding 4
    bytes each) agree and give E4M3 codes of e2m1 * 2^-6 of the low / high nibble of every byte."""
    b = np.arange(256, dtype=np.uint8)
    lo, hi = (np.asarray(v, np.uint8) for v in fp_decode.e2m1_e4m3_planes(jnp.asarray(b)[None], interpret=True))
    f8 = lambda v: v.view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # noqa: E731
    scale = 2.0 ** fp_decode.E4M3_FROM_E2M1_LOG2
    np.testing.assert_array_equal(f8(lo[0]), fp_decode.FP4_VALUES[b & 15] * scale)
    np.testing.assert_array_equal(f8(hi[0]), fp_decode.FP4_VALUES[b >> 4] * scale)
    rng = np.random.default_rng(5)
    words = np.concatenate([b.view(np.uint32), rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)])
    wb = words.view(np.uint8)
    for asm, plane in zip(fp_decode.E4M3_ASM, fp_decode.e2m1_e4m3_planes(jnp.asarray(wb)[None], interpret=True)):
        np.testing.assert_array_equal(_ptx_run(asm, words).view(np.uint8), np.asarray(plane, np.uint8)[0])


@pytest.fixture(scope="module")
def fp8_tree():
    """An fp8-format parameter tree of a tiny config with K = 256 everywhere the tiled layout needs it (random
    bytes in the GEMM weights, zeros elsewhere: the conversions only look at shapes and bytes)."""
    import jax

    from dsv41_jax.config import ModelConfig
    from dsv41_jax.params import abstract_params

    cfg = ModelConfig.preset("tiny", dim=256, moe_inter_dim=256)
    rng = np.random.default_rng(9)

    def leaf(a):
        if a.dtype in (np.uint8, jnp.float8_e4m3fn):
            return rng.integers(0, 256, a.shape, dtype=np.uint8).view(a.dtype)
        return np.zeros(a.shape, a.dtype)
    return cfg, jax.tree.map(leaf, abstract_params(cfg))


def test_tree_layouts_round_trip(fp8_tree):
    """to_kernel_layout / to_official_layout over a whole tree: the default layouts (official) move nothing;
    tiled experts differ from the checkpoint's bytes, the rest is untouched, and the way back is bit-exact."""
    import jax

    from checkpoints.kernel_layout import kernel_layouts, to_kernel_layout, to_official_layout
    from checkpoints.tree import flat

    cfg, p = fp8_tree
    assert kernel_layouts() == {"exp": "official", "lin": "official"}
    same = flat(to_kernel_layout(cfg, p))
    for path, v in flat(p).items():
        np.testing.assert_array_equal(np.asarray(same[path]).view(np.uint8), np.asarray(v).view(np.uint8))
    lay = {"exp": "tiled", "lin": "official"}
    k = to_kernel_layout(cfg, p, lay)
    back = flat(to_official_layout(cfg, k, lay))
    kf = flat(k)
    for path, v in flat(p).items():
        raw = np.asarray(v).view(np.uint8) if v.dtype.itemsize == 1 else np.asarray(v)
        moved = path[-1] == "weight" and "experts" in path
        assert moved != np.array_equal(np.asarray(kf[path]).view(raw.dtype), raw), path
        np.testing.assert_array_equal(np.asarray(back[path]).view(raw.dtype), raw)
    assert jax.tree.structure(k) == jax.tree.structure(p)
    with pytest.raises(ValueError):
        to_kernel_layout(cfg, p, {"exp": "official", "lin": "tiled"})
