"""The Mega-mHC kernel (pallas_kernels/mega_mhc, interpret mode, GPU-legal blocks) against its one jnp reference,
dsv41_jax.layers.hc_boundary (the ops seam's XLA branch), with the FP8 quantisation of dsv41_jax.quant; both
launch variants, several row / chunk splits, stacked weights read in place; the ops seam's Pallas branch against
its XLA branch on the tiny model's parameters; the GPU lowering at the full shape.

Outputs are fresh buffers that interpret mode fills with NaN: every element the kernel fails to write shows up as
non-finite. Contract (the kernel's docstring): h' within one bf16 ulp; x within one where the column's h' copies
equal the reference's, else a few (x sums them); under 1% of the elements differ at all; xq exactly fp8_qdq of the
kernel's x, mix' within 1e-5 relative."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import layers, ops, quant
from dsv41_jax.weights import LayerRef
from pallas_kernels.common import lower_for_h200
from pallas_kernels.mega_mhc import MhcBlocks, hc_boundary

HC, MW, ITERS, EPS, NORM_EPS = 4, 24, 20, 1e-6, 1e-20


class _Cfg:  # the fields layers.hc_boundary reads
    hc_mult, hc_sinkhorn_iters, hc_eps, norm_eps = HC, ITERS, EPS, NORM_EPS


def _mixes(rng, n):
    pre = rng.uniform(0.1, 1, (n, HC))
    post = rng.uniform(0, 2, (n, HC))
    comb = rng.dirichlet(np.ones(HC), (n, HC))
    return jnp.asarray(np.concatenate([pre, post, comb.reshape(n, -1)], -1), jnp.float32)


def make_case(seed, n, d, layers_=3):
    rng = np.random.default_rng(seed)
    y = jnp.asarray(rng.normal(0, 1, (n, d)), jnp.bfloat16)
    h = jnp.asarray(rng.normal(0, 1, (n, HC, d)), jnp.bfloat16)
    fn = jnp.asarray(rng.normal(0, (HC * d) ** -0.5, (layers_, MW, HC * d)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 1, (layers_, 3)), jnp.float32)
    base = jnp.asarray(rng.normal(0, 0.5, (layers_, MW)), jnp.float32)
    norm = jnp.asarray(1 + 0.1 * rng.normal(0, 1, (layers_, d)), jnp.bfloat16)
    return y, h, _mixes(rng, n), fn, scale, base, norm


def _ulps_bf16(got, want):
    """|got - want| in bf16 ulps of want (2^(e - 7) for |want| in [2^e, 2^(e+1)))."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    _, e = np.frexp(np.maximum(np.abs(w), 2.0 ** -126))
    return np.abs(g - w) / np.ldexp(1.0, e - 8)


def check(got, want_h, want_x, want_mix):
    h, x, xq, mix = got
    for a in (h, x, mix) + (() if xq is None else (xq,)):
        assert np.isfinite(np.asarray(a, np.float32)).all()  # every element written
    for g, w in ((h, want_h), (x, want_x)):
        assert g.shape == w.shape
        u = _ulps_bf16(g, w)
        assert np.mean(u > 0) < 0.01
        if g is x:  # x sums the hc copies of h' at a column: where one is an ulp off, x may be a few ulps off
            same_h = np.all(_ulps_bf16(h, want_h) == 0, axis=-2).reshape(u.shape)
            assert u[same_h].max(initial=0) <= 1.0 and u.max() <= 8.0
        else:
            assert u.max() <= 1.0
    np.testing.assert_allclose(np.asarray(mix), np.asarray(want_mix), rtol=1e-5, atol=1e-6)
    if xq is not None:
        np.testing.assert_array_equal(np.asarray(xq, np.float32), np.asarray(quant.fp8_qdq(x, 32), np.float32))


@pytest.mark.parametrize("n,d,blocks,single", [
    (1, 256, MhcBlocks(16, 64, 4), True),  # one row block, 4 chunks
    (5, 256, MhcBlocks(16, 128, 4), False),  # partial row block, two launches
    (40, 128, MhcBlocks(16, 32, 4), True),  # 3 row blocks (the last partial) x 4 chunks
    (40, 128, MhcBlocks(32, 128, 8), False),  # 2 row blocks, one chunk
])
def test_kernel_matches_reference(n, d, blocks, single):
    y, h, mix, fn, scale, base, norm = make_case(n * 7 + d, n, d)
    l = 1
    want = layers.hc_boundary(_Cfg, h, y, mix, fn[l], scale[l], base[l], norm[l])
    got = hc_boundary(y, h, mix, fn, scale, base, norm, layer=jnp.int32(l), hc=HC, iters=ITERS, eps=EPS,
                      norm_eps=NORM_EPS, quantize=True, single_launch=single, blocks=blocks)
    check(got, *want)
    # exactness measured in interpret mode (stronger than the GPU contract above)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))


@pytest.mark.parametrize("n,single,max_unroll", [(3, True, 64), (2, False, 64), (4, True, 2), (6, False, 2),
                                                  (18, True, 64), (21, True, 2)])
def test_steps_unrolled_and_looped(monkeypatch, n, single, max_unroll):
    """D = 1024 in 128-column chunks: 8 partials to add, then the normalisation, unrolled (MAX_UNROLL 64) or in
    loops (MAX_UNROLL 2): N < 16 rows one at a time (one [1, 1024] step a row in one launch, one [1, 128] step a
    row and chunk in two), N >= 16 in [16, 256] tiles (4 steps a block; the second block of 18 / 21 rows is
    partial). A distinct n per case: the kernel reads MAX_UNROLL when traced. (n = 20 draws a row whose
    Sinkhorn turns the logits' f32 sum-order differences into a 6e-5 difference of mix': the module's numerics
    contract.)"""
    from pallas_kernels.mega_mhc import kernel
    monkeypatch.setattr(kernel, "MAX_UNROLL", max_unroll)
    y, h, mix, fn, scale, base, norm = make_case(n + 100, n, 1024)
    got = hc_boundary(y, h, mix, fn, scale, base, norm, layer=jnp.int32(2), hc=HC, iters=ITERS, eps=EPS,
                      norm_eps=NORM_EPS, quantize=True, single_launch=single, blocks=MhcBlocks(16, 128, 4))
    check(got, *layers.hc_boundary(_Cfg, h, y, mix, fn[2], scale[2], base[2], norm[2]))


def test_unstacked_weights_without_quantisation():
    y, h, mix, fn, scale, base, norm = make_case(3, 3, 64)
    got = hc_boundary(y, h, mix, fn[0], scale[0], base[0], norm[0], hc=HC, iters=ITERS, eps=EPS,
                      norm_eps=NORM_EPS, quantize=False)
    assert got[2] is None
    check(got, *layers.hc_boundary(_Cfg, h, y, mix, fn[0], scale[0], base[0], norm[0]))


def test_owing_nothing_settles_exactly(tiny):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(0, 3, (2, 3, tiny.hc_mult, tiny.dim)), jnp.bfloat16)
    pre = jnp.asarray(rng.uniform(0, 1, (2, 3, tiny.hc_mult)), jnp.float32)
    res = ops.Residual.owing_nothing(tiny, h, pre).settled(tiny)
    np.testing.assert_array_equal(np.asarray(res.h, np.float32), np.asarray(h, np.float32))
    np.testing.assert_array_equal(np.asarray(res.pre), np.asarray(pre))


def test_fp8_qdq_is_idempotent():
    """The GEMMs fed the kernel's xq skip their own quantisation: valid because fp8_qdq(fp8_qdq(x)) == fp8_qdq(x)."""
    x = jax.random.normal(jax.random.key(1), (64, 512), jnp.float32) * jnp.logspace(-6, 3, 512)
    x = x.astype(jnp.bfloat16)
    once = quant.fp8_qdq(x, 32)
    np.testing.assert_array_equal(np.asarray(quant.fp8_qdq(once, 32), np.float32), np.asarray(once, np.float32))


@pytest.mark.parametrize("sub", ["attn", "ffn"])
def test_ops_pallas_branch_matches_xla(tiny, tiny_params, sub):
    rng = np.random.default_rng(5)
    B, T = 2, 3
    res = ops.Residual(jnp.asarray(rng.normal(0, 1, (B, T, tiny.hc_mult, tiny.dim)), jnp.bfloat16),
                       jnp.asarray(rng.normal(0, 1, (B, T, tiny.dim)), jnp.bfloat16),
                       _mixes(rng, B * T).reshape(B, T, MW))
    w = LayerRef(tiny_params["layers"], jnp.int32(2))
    want = ops.hc_boundary(ops.ExecContext(), tiny, res, w, sub)
    got = ops.hc_boundary(ops.ExecContext(kernels="pallas"), tiny, res, w, sub)
    assert want[2] is None and (got[2] is not None) == (tiny.weight_format == "fp8")
    check(got, want[0], want[1], want[3])


@pytest.mark.parametrize("n,single", [(1, True), (256, False)])
def test_lowers_for_the_h200_at_the_full_shape(n, single):
    sds = jax.ShapeDtypeStruct
    D, L = 5120, 40

    def f(y, h, m, fn, s, b, w, l):
        return hc_boundary(y, h, m, fn, s, b, w, layer=l, hc=HC, iters=ITERS, eps=EPS, norm_eps=NORM_EPS,
                           quantize=True, single_launch=single, interpret=False)

    text = lower_for_h200(f, sds((n, D), jnp.bfloat16), sds((n, HC, D), jnp.bfloat16), sds((n, MW), jnp.float32),
                          sds((L, MW, HC * D), jnp.float32), sds((L, 3), jnp.float32), sds((L, MW), jnp.float32),
                          sds((L, D), jnp.bfloat16), sds((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == (1 if single else 2)
