"""The training forms of the attention core (dsv41_jax.train_attention, selected by ops.TrainHooks.attention)
compute the served attention: same outputs and gradients up to rounding, on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import attention
from dsv41_jax.config import ModelConfig
from dsv41_jax.train_attention import onepass_core
from tests.training_steps import run_clean


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


# ----------------------------------------------------------------------------- blocked attention
def _core_case(cfg, B, T, C, k, seed, clip):
    """Random operands of one fresh CSA2 call (window + selected latents): distinct sorted ids per row, some -1."""
    import dataclasses

    from dsv41_jax import model, ops
    from dsv41_jax.kv_cache import DenseGlobal

    H, d = cfg.n_heads, cfg.head_dim
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    dt = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32
    q = (2 * jax.random.normal(ks[0], (B, T, H, d), jnp.float32)).astype(dt)
    kv = jax.random.normal(ks[1], (B, T, d), jnp.float32).astype(dt)
    lat = jax.random.normal(ks[2], (B, C, d), jnp.float32).astype(dt)
    order = jnp.argsort(jax.random.uniform(ks[3], (B, T, C)), axis=-1)[..., :k]
    sel = jnp.sort(order, axis=-1)
    sel = jnp.where(jax.random.bernoulli(ks[4], 0.2, sel.shape), -1, sel).astype(jnp.int32)
    sink = jax.random.normal(ks[5], (H,), jnp.float32)
    state = model.init_state(cfg, B, T)
    r = 1 if 1 in state.glob.lat else next(iter(state.glob.lat))
    glob = DenseGlobal({**state.glob.lat, r: state.glob.lat[r].at[0, :, :C].set(lat)}, state.glob.idx)
    state = dataclasses.replace(state, glob=glob)
    a = ops.AttentionOperands(q=q, chunk_kv=kv, pos0=jnp.zeros((B,), jnp.int32), clip=jnp.asarray(clip, jnp.int32),
                              sel=sel, sink=sink, layer=jnp.asarray(0, jnp.int32), src=jnp.asarray(0, jnp.int32),
                              ratio=r, fresh=True)
    return a, state


def _core(cfg, a, state, attention):
    from dsv41_jax import ops

    ex = ops.ExecContext(hooks=ops.TrainHooks(attention=attention))
    return ops.csa_attention(ex, cfg, a, state)


def check_blocked_core(cfg, tol, *, B, T, C, seed, clip):
    """ops.csa_attention with TrainHooks(attention="blocked") vs the served gathered core on one random case
    (_core_case, top-k = cfg.index_topk): the output and the gradients w.r.t. q, chunk kv, latents and sink of a
    random-weighted sum, each to tol relative to its largest element."""
    import dataclasses

    a, state = _core_case(cfg, B=B, T=T, C=C, k=cfg.index_topk, seed=seed, clip=clip)
    want, got = _core(cfg, a, state, "served"), _core(cfg, a, state, "blocked")
    assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0.1
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    w = jax.random.normal(jax.random.PRNGKey(seed + 7), want.shape, jnp.float32)
    r = a.ratio

    def loss(attention, q, kv, lat, sink):
        b = dataclasses.replace(a, q=q, chunk_kv=kv, sink=sink)
        s = dataclasses.replace(state, glob=dataclasses.replace(
            state.glob, lat={**state.glob.lat, r: state.glob.lat[r].at[0].set(lat)}))
        return jnp.sum(_core(cfg, b, s, attention).astype(jnp.float32) * w)

    args = (a.q, a.chunk_kv, state.glob.lat[r][0], a.sink)
    gw = jax.grad(lambda *x: loss("served", *x), argnums=(0, 1, 2, 3))(*args)
    gg = jax.grad(lambda *x: loss("blocked", *x), argnums=(0, 1, 2, 3))(*args)
    for x, y in zip(gg, gw):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.max(np.abs(y)) > 0
        np.testing.assert_allclose(x, y, atol=tol * np.max(np.abs(y)), rtol=tol)


def test_blocked_core_equals_the_served_core():
    """T = 45 over window 8 (wrap, a partial last block), top-8 of 40 latents, a replay clip on one sequence.
    f32: outputs and gradients (q, chunk kv, latents, sink) to 1e-5; bf16: to bf16 rounding."""
    import dataclasses

    tiny = ModelConfig.preset("tiny")
    for cfg, tol in ((dataclasses.replace(tiny, compute_dtype="float32"), 1e-5), (tiny, 2e-2)):
        check_blocked_core(cfg, tol, B=2, T=45, C=40, seed=1, clip=[0, 13])


@pytest.mark.timeout(1800)
def test_flash_training_step_equals_served_tiny():
    """The tiny preset, T = 45 (window 8 wraps 5 times, 22 / 45 compressed entries, top-8), f32 without qdq: the
    training step with attention="flash" (the fused kernels, interpret mode here; the trainer's form on the GPU)
    against the served attention: loss to 1e-6, all gradient leaves together to 1e-4 relative L2, each leaf to
    2e-4 (`check_model` in tests/training_steps.py; measured 1.5e-5 for all, 1.2e-4 for the largest leaf: the
    attention's own gradients agree to ~1e-6, the model amplifies f32 summation-order differences in a few small
    leaves). "blocked" computes the same quantity: its core is checked against the served core (forward and
    gradients, f32 and bf16) here and at the default model's training config (tests/test_training_attention_default.py),
    and against "flash" in tests/kernels/test_train_attention.py."""
    run_clean("tiny = ModelConfig.preset('tiny')\n"
              "check_model(dataclasses.replace(tiny, compute_dtype='float32', qdq=False), 2, 45, 1e-6, 2e-4)")
