"""The mHC-coefficient kernel (interpret mode) against its one jnp reference (the model's layers.hc_coefficients,
also the ops seam's XLA branch) and the model's hc_mixes; GPU lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import layers
from pallas_kernels.common import lower_for_h200
from pallas_kernels.mhc import hc_coefficients


@pytest.mark.parametrize("n", [1, 5, 40])
def test_kernel_matches_reference(n):
    rng = np.random.default_rng(n)
    m = jnp.asarray(rng.normal(0, 2, (n, 24)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 1.0, 3), jnp.float32)
    base = jnp.asarray(rng.normal(0, 0.5, 24), jnp.float32)
    got = hc_coefficients(m, scale, base, hc=4, iters=20, eps=1e-6, block_rows=16)
    want = layers.hc_coefficients(m, scale, base, hc=4, iters=20, eps=1e-6)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and np.isfinite(g).all()
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)
    comb = np.asarray(got[2])
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-4)  # ends on a column normalisation


def test_reference_is_the_model_hc_mixes(tiny, tiny_params):
    rng = np.random.default_rng(7)
    lp = jax.tree.map(lambda a: a[2], tiny_params["layers"])
    x = jnp.asarray(rng.normal(0, 1, (3, 5, tiny.hc_mult, tiny.dim)), jnp.bfloat16)
    pre, post, comb = layers.hc_mixes(tiny, x, lp["hc_attn_fn"], lp["hc_attn_scale"], lp["hc_attn_base"])
    xf = x.astype(jnp.float32).reshape(3, 5, -1)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + tiny.norm_eps)
    m = layers.mm(xf, lp["hc_attn_fn"].astype(jnp.float32), "...i,oi->...o") * r
    for got, want in zip(hc_coefficients(m, lp["hc_attn_scale"], lp["hc_attn_base"], hc=4,
                                         iters=tiny.hc_sinkhorn_iters, eps=tiny.hc_eps), (pre, post, comb)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_lowers_for_the_h200():
    sds = jax.ShapeDtypeStruct
    text = lower_for_h200(lambda m, s, b: hc_coefficients(m, s, b, hc=4, iters=20, eps=1e-6, interpret=False),
                          sds((32, 24), jnp.float32), sds((3,), jnp.float32), sds((24,), jnp.float32))
    assert "hc_coefficients" in text or "triton" in text


def test_layer_stack_read_in_place():
    """With `layer`, the kernel reads row `layer` of the scale / base stacks: equal to the sliced call, and a
    different layer gives different coefficients (the index is not ignored)."""
    rng = np.random.default_rng(3)
    m = jnp.asarray(rng.normal(0, 2, (6, 24)), jnp.float32)
    scales = jnp.asarray(rng.uniform(0.5, 1.0, (5, 3)), jnp.float32)
    bases = jnp.asarray(rng.normal(0, 0.5, (5, 24)), jnp.float32)
    for layer in (0, 3):
        got = jax.jit(lambda m, s, b, l: hc_coefficients(m, s, b, hc=4, iters=20, eps=1e-6, layer=l))(
            m, scales, bases, jnp.int32(layer))
        want = layers.hc_coefficients(m, scales[layer], bases[layer], hc=4, iters=20, eps=1e-6)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6)
    other = hc_coefficients(m, scales, bases, hc=4, iters=20, eps=1e-6, layer=jnp.int32(1))
    assert not np.allclose(np.asarray(other[2]), np.asarray(got[2]))


def test_lowers_for_the_h200_with_a_layer_stack():
    sds = jax.ShapeDtypeStruct
    text = lower_for_h200(
        lambda m, s, b, l: hc_coefficients(m, s, b, hc=4, iters=20, eps=1e-6, interpret=False, layer=l),
        sds((32, 24), jnp.float32), sds((40, 3), jnp.float32), sds((40, 24), jnp.float32), sds((), jnp.int32))
    assert "hc_coefficients" in text or "triton" in text
