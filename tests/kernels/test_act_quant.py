"""FP8 activation quantisation inside the GEMM kernels (pallas_kernels/act_quant.py, `quantize_x`): the tile helpers
equal dsv41_jax.quant.fp8_encode bit for bit on random rows spread over binades (zero blocks and saturating values
included); the dense GEMMs (v1 and FP8-dot blocks, split K, prefetch, stacked weights with a traced layer) fed raw
bf16 / f32 x equal the reference on fp8_qdq(x) in interpret mode; the MoE kernels likewise (grouped_matmul,
grouped_swiglu); and they lower for the H200 with no XLA quantisation left outside the kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels import act_quant, common
from pallas_kernels.gemm import GemmBlock, matmul, ref_matmul
from pallas_kernels.gemm.kernel import dequant_fp8
from pallas_kernels.moe import MoeBlock, grouped_matmul, grouped_swiglu, ref_grouped_matmul, ref_grouped_swiglu
from pallas_kernels.moe.kernel import dequant_mxfp4
from tests.kernels import test_fp8_dot
from tests.kernels.test_fp8_dot import GROUPS, INTERPRET, K, M, bound_check


def raw_rows(key, m, k, dtype=jnp.bfloat16):
    """Unquantised activations over binades, with one all-zero block and one block past E4M3's range."""
    k1, k2 = jax.random.split(key)
    e = jax.random.randint(k2, (m, k // 32, 1), -8, 8)
    x = jax.random.normal(k1, (m, k)) * jnp.exp2(e).repeat(32, -1).reshape(m, k)
    x = x.at[0, :32].set(0.0).at[-1, 32:64].multiply(1e4)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tile_helpers_equal_fp8_encode(dtype):
    x = raw_rows(jax.random.key(0), 7, 256, dtype)
    q, c = quant.fp8_encode(x, 32)
    codes, mult = act_quant.quantize_tile(x)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)))
    np.testing.assert_array_equal(np.asarray(mult), np.asarray(quant.e8m0_code_to_f32(c)))
    np.testing.assert_array_equal(np.asarray(act_quant.qdq_tile(x, jnp.bfloat16), np.float32),
                                  np.asarray(quant.fp8_qdq(x.astype(jnp.float32), 32).astype(jnp.bfloat16), np.float32))


dense = test_fp8_dot.dense  # its FP8 block-32 weights fixture


@pytest.mark.parametrize("m,blk", [
    (1, GemmBlock(2, 64, 256, decode="fp8", nb=8, swap=True)),
    (5, GemmBlock(8, 32, 64, 2, decode="fp8", nb=2, prefetch=True)),
    (40, GemmBlock(16, 128, 64, decode="fp8", nb=2)),
    (5, GemmBlock(16, 32, 64, 2)),  # v1: bf16 dots on the qdq'd tile
    (40, GemmBlock(16, 64, 128, swap=True)),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dense_quantize_x(dense, m, blk, dtype):
    q, s = dense
    x = raw_rows(jax.random.key(m), m, K, dtype)
    xg = quant.fp8_qdq(x.astype(jnp.float32), 32).astype(jnp.bfloat16)  # what the model multiplies
    f = jax.jit(lambda x, lyr: matmul(x, q, scale=s, layer=lyr, quantize_x=True, block=blk, interpret=INTERPRET))
    for layer in (1, 0):
        y = f(x, jnp.int32(layer))
        bound_check(y, ref_matmul(xg, q, scale=s, layer=layer), xg, dequant_fp8(q[layer], s[layer]))
    np.testing.assert_array_equal(np.asarray(matmul(x, q[0], scale=s[0], quantize_x=True, implementation="xla")),
                                  np.asarray(ref_matmul(xg, q[0], scale=s[0])))


def test_dense_quantize_x_bad_args(dense):
    q, s = dense
    x = raw_rows(jax.random.key(1), 2, K)
    with pytest.raises(ValueError, match="not both"):
        matmul(x, q[0], scale=s[0], quantize_x=True, x_scale=jnp.zeros((2, K // 32), jnp.uint8))
    with pytest.raises(ValueError, match="K % 32"):
        matmul(x[:, :48], q[0][:, :48], scale=s[0][:, :1], quantize_x=True)


@pytest.mark.parametrize("blk", [None, GemmBlock(1, 128, 512, decode="fp8", nb=16, swap=True, fast_accum=True,
                                                 prefetch=True)])
def test_dense_quantize_x_lowers_for_h200(blk):
    sd = jax.ShapeDtypeStruct
    args = [sd((1, 5120), jnp.bfloat16), sd((4, 2304, 5120), jnp.float8_e4m3fn),
            sd((4, 2304 // 32, 5120 // 32), jnp.float8_e8m0fnu), sd((), jnp.int32)]
    fn = lambda x, w, s, l: matmul(x, w, scale=s, layer=l, quantize_x=True, interpret=False, block=blk)  # noqa: E731
    text = common.lower_for_h200(fn, *args)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "reduce" not in text.split("__gpu$xla.gpu.triton")[0]  # no amax reduction outside the kernel


experts = test_fp8_dot.experts  # its MXFP4 experts fixture

MOE_BLOCKS = [MoeBlock(2, 32, 256, decode="fp8", nb=8, swap=True),
              MoeBlock(8, 64, 64, splits=2, decode="fp8", nb=2, prefetch=True),
              MoeBlock(16, 32, 128),  # v1 bf16x2 planes: the x halves qdq'd in the kernel
              MoeBlock(16, 64, 64, splits=2)]


@pytest.mark.parametrize("blk", MOE_BLOCKS)
def test_grouped_quantize_x(experts, blk):
    p, s, _ = experts
    gs = jnp.asarray(GROUPS, jnp.int32)
    x = raw_rows(jax.random.key(7), M, K)
    xg = quant.fp8_qdq(x.astype(jnp.float32), 32).astype(jnp.bfloat16)
    f = jax.jit(lambda x, lyr: grouped_matmul(x, p, gs, scale=s, layer=lyr, quantize_x=True, block=blk,
                                              interpret=INTERPRET))
    y = f(x, jnp.int32(1))
    bound_check(y, ref_grouped_matmul(xg, p, gs, scale=s, layer=1), xg, dequant_mxfp4(p[1], s[1]), GROUPS)
    np.testing.assert_array_equal(
        np.asarray(grouped_matmul(x, p[0], gs, scale=s[0], quantize_x=True, implementation="xla")),
        np.asarray(ref_grouped_matmul(xg, p[0], gs, scale=s[0])))


@pytest.mark.parametrize("blk", [MOE_BLOCKS[0], MOE_BLOCKS[1], MoeBlock(16, 32, 128)])
def test_grouped_swiglu_quantize_x(experts, blk):
    p, s, _ = experts
    gs = jnp.asarray(GROUPS, jnp.int32)
    x = raw_rows(jax.random.key(8), M, K)
    xg = quant.fp8_qdq(x.astype(jnp.float32), 32).astype(jnp.bfloat16)
    rw = jax.random.uniform(jax.random.key(5), (M,), jnp.float32, 0.05, 1.0)
    h = grouped_swiglu(x, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.5, quantize_x=True, block=blk,
                       interpret=INTERPRET)
    ref = ref_grouped_swiglu(xg, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.5)
    h, ref = np.asarray(h, np.float64), np.asarray(ref, np.float64)
    n = sum(GROUPS)
    np.testing.assert_array_equal(h[n:], 0.0)
    np.testing.assert_allclose(h[:n], ref[:n], rtol=2 ** -7, atol=1e-6 * np.abs(ref).max())
    assert np.mean(h[:n] == ref[:n]) > 0.95 and np.abs(ref[:n]).max() > 0.1


def test_moe_quantize_x_lowers_for_h200():
    """The model's MoE at batch 1 (6 rows, 384 experts): both kernels lower with their x quantized inside."""
    sd = jax.ShapeDtypeStruct
    E_, D, I = 384, 5120, 2304
    gs = np.zeros(E_, np.int32)
    gs[[3, 50, 77, 190, 200, 383]] = 1

    def fn(x, w1, s1, w3, s3, w2, s2, rw, lyr):
        h = grouped_swiglu(x, w1, w3, gs, rw, scale1=s1, scale3=s3, layer=lyr, quantize_x=True, interpret=False)
        return grouped_matmul(h, w2, gs, scale=s2, layer=lyr, quantize_x=True, interpret=False)

    args = [sd((6, D), jnp.bfloat16), sd((2, E_, I, D // 2), jnp.uint8), sd((2, E_, I, D // 32), jnp.uint8),
            sd((2, E_, I, D // 2), jnp.uint8), sd((2, E_, I, D // 32), jnp.uint8),
            sd((2, E_, D, I // 2), jnp.uint8), sd((2, E_, D, I // 32), jnp.uint8), sd((6,), jnp.float32),
            sd((), jnp.int32)]
    text = common.lower_for_h200(fn, *args)
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("blk", MOE_BLOCKS + [MoeBlock(2, 32, 256, decode="fp8", nb=8, w13="grid")])
def test_all_rows_routed_needs_no_zeroed_output(experts, blk):
    """Sizes summing to M (every row routed, as the model's N * k rows): with all_rows_routed the kernels get no
    zeroed buffer (the pallas_call's own output, which interpret mode fills with garbage) and must write every
    element; the result equals the zero-initialised path's, and the lowered program has no zero broadcast."""
    p, s, _ = experts
    groups = np.asarray(GROUPS) + np.asarray([1, 0, 1, 1, 0, 1, 0, 0])  # 40 rows = M: no padding
    assert groups.sum() == M
    gs = jnp.asarray(groups, jnp.int32)
    x = raw_rows(jax.random.key(9), M, K)
    rw = jax.random.uniform(jax.random.key(5), (M,), jnp.float32, 0.05, 1.0)
    for routed in (False, True):
        kw = dict(quantize_x=True, block=blk, interpret=INTERPRET, all_rows_routed=routed)
        y = grouped_matmul(x, p[1], gs, scale=s[1], **kw) if blk.w13 == "joint" else None
        h = grouped_swiglu(x, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.5, **kw)
        if not routed:
            y0, h0 = y, h
    if y is not None:
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h0, np.float32))


def test_all_rows_routed_lowers_without_zeros():
    sd = jax.ShapeDtypeStruct
    gs = sd((16,), jnp.int32)
    for routed in (False, True):
        text = common.lower_for_h200(
            lambda x, w, s, g: grouped_matmul(x, w, g, scale=s, quantize_x=True, all_rows_routed=routed,  # noqa: B023
                                              interpret=False),
            sd((6, 2304), jnp.bfloat16), sd((16, 5120, 1152), jnp.uint8), sd((16, 5120, 72), jnp.uint8), gs)
        assert ("stablehlo.constant dense<0.000000e+00>" in text) != routed

