"""The training forms of the attention core (dsv41_jax.train_attention, selected by ops.TrainHooks.attention)
compute the served attention: same outputs and gradients up to rounding, on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import attention
from dsv41_jax.config import ModelConfig
from dsv41_jax.train_attention import onepass_core


def test_onepass_core_matches_the_served_core():
    """Random q, keys, masks, sinks (one row with no valid key at all: only the sink, a zero output)."""
    cfg = ModelConfig.preset("tiny")
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    B, T, H, K, d = 2, 5, 4, 200, 64
    q = jax.random.normal(k[0], (B, T, H, d), jnp.float32).astype(jnp.bfloat16)
    keys = (2 * jax.random.normal(k[1], (B, T, K, d), jnp.float32)).astype(jnp.bfloat16)
    valid = jax.random.bernoulli(k[2], 0.6, (B, T, K)).at[0, 0].set(False)
    sink = jax.random.normal(k[3], (H,), jnp.float32)
    want = attention.sparse_attention(cfg, q, keys, valid, sink, d ** -0.5).astype(jnp.float32)
    got = onepass_core(cfg, q, keys, valid, sink, d ** -0.5).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(want))) > 0.05
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2, rtol=2e-2)
    assert float(jnp.max(jnp.abs(got[0, 0]))) == 0.0
    f = lambda fn: lambda qq: jnp.sum(fn(cfg, qq, keys, valid, sink, d ** -0.5).astype(jnp.float32) ** 2)  # noqa: E731
    gw, gg = jax.grad(f(attention.sparse_attention))(q), jax.grad(f(onepass_core))(q)
    np.testing.assert_allclose(np.asarray(gg, np.float32), np.asarray(gw, np.float32), atol=5e-2, rtol=5e-2)
