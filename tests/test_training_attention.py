"""The training forms of the attention core (dsv41_jax.train_attention, selected by ops.TrainHooks.attention)
compute the served attention: same outputs and gradients up to rounding, on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_blocked_core_equals_the_served_core():
    """ops.csa_attention with TrainHooks(attention="blocked") vs the served gathered core on random operands:
    T = 45 over window 8 (wrap, a partial last block), top-8 of 40 latents, a replay clip on one sequence.
    f32: outputs and gradients (q, chunk kv, latents, sink) to 1e-5; bf16: to bf16 rounding."""
    import dataclasses

    tiny = ModelConfig.preset("tiny")
    for cfg, tol in ((dataclasses.replace(tiny, compute_dtype="float32"), 1e-5), (tiny, 2e-2)):
        a, state = _core_case(cfg, B=2, T=45, C=40, k=cfg.index_topk, seed=1, clip=[0, 13])
        want, got = _core(cfg, a, state, "served"), _core(cfg, a, state, "blocked")
        assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0.1
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
        w = jax.random.normal(jax.random.PRNGKey(9), want.shape, jnp.float32)

        def loss(attention, q, kv, lat, sink):
            b = dataclasses.replace(a, q=q, chunk_kv=kv, sink=sink)
            r = a.ratio
            s = dataclasses.replace(state, glob=dataclasses.replace(
                state.glob, lat={**state.glob.lat, r: state.glob.lat[r].at[0].set(lat)}))
            return jnp.sum(_core(cfg, b, s, attention).astype(jnp.float32) * w)

        args = (a.q, a.chunk_kv, state.glob.lat[a.ratio][0], a.sink)
        gw = jax.grad(lambda *x: loss("served", *x), argnums=(0, 1, 2, 3))(*args)
        gg = jax.grad(lambda *x: loss("blocked", *x), argnums=(0, 1, 2, 3))(*args)
        for x, y in zip(gg, gw):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            assert np.max(np.abs(y)) > 0
            np.testing.assert_allclose(x, y, atol=tol * np.max(np.abs(y)), rtol=tol)


def _loss_and_grads(cfg, attention, B, T, seed=0):
    from dsv41_jax.engram_hash import EngramHasher
    from dsv41_jax.ops import TrainHooks
    from training import data as D
    from training import objective as O

    m = jax.jit(lambda: O.init_masters(cfg, seed))()
    win = np.random.default_rng(seed).integers(1, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    batch = D.host_batch(cfg, EngramHasher(cfg), win)
    hooks = TrainHooks(balance=True, indexer_stride=4, attention=attention)

    def f(m):
        return O.loss_and_metrics(cfg, m, *batch, aux_weight=0.1, hooks=hooks)

    (loss, met), g = jax.jit(jax.value_and_grad(f, has_aux=True))(m)
    return float(loss), float(met["ce"]), jax.tree.leaves(g)


def _grad_error(gx, gy):
    """Relative L2 distance of two gradient trees (all leaves together), and whether any leaf is non-finite."""
    num = sum(float(np.sum((np.asarray(x, np.float32) - np.asarray(y, np.float32)) ** 2)) for x, y in zip(gx, gy))
    den = sum(float(np.sum(np.asarray(y, np.float32) ** 2)) for y in gy)
    assert den > 0 and all(np.all(np.isfinite(np.asarray(x))) for x in gx)
    return (num / den) ** 0.5


def _check_model(cfg, B, T, tol_loss, tol_grad):
    """Loss and gradients of the training step's objective, blocked vs served attention. f32 (tol_grad a number):
    every leaf to tol_grad relative L2. bf16 + qdq (tol_grad None): the step's routing, top-k and FP8 points
    turn bf16 rounding into large gradient changes at initialisation, so the bar is the served core's own
    rounding sensitivity: blocked is no farther from served than the one-pass core (same math, other rounding),
    times 1.5."""
    lw, cw, gw = _loss_and_grads(cfg, "served", B, T)
    lg, cg, gg = _loss_and_grads(cfg, "blocked", B, T)
    assert abs(lg - lw) <= tol_loss * abs(lw) and abs(cg - cw) <= tol_loss * abs(cw), (lg, lw, cg, cw)
    if tol_grad is not None:
        for x, y in zip(gg, gw):
            assert _grad_error([x], [y]) <= tol_grad if np.any(np.asarray(y)) else not np.any(np.asarray(x))
        assert _grad_error(gg, gw) <= 1e-4
        return
    _, _, go = _loss_and_grads(cfg, "onepass", B, T)
    err, noise = _grad_error(gg, gw), _grad_error(go, gw)
    assert err <= 1.5 * noise, (err, noise)


def _run_clean(call: str):
    """Run `call` (a _check_model call) in a fresh interpreter at XLA's default CPU optimisation level: the
    suite's --xla_backend_optimization_level=0 (tests/conftest.py) makes the model's backward NaN for the served
    attention and this one alike (a scan of the step; not an attention property), so the comparison runs at the
    level that training compiles with."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{root}{os.pathsep}{root / 'tests'}")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_backend_optimization_level"))
    code = ("import dataclasses\nfrom dsv41_jax.config import ModelConfig\n"
            "from training.train_default import model_config\nfrom test_training_attention import _check_model\n"
            f"{call}\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.timeout(1800)
def test_blocked_training_step_equals_served_tiny():
    """The tiny preset, T = 45 (window 8 wraps 5 times, 22 / 45 compressed entries, top-8): f32 without qdq
    tight (loss 1e-6, every gradient leaf to 1e-4 relative L2); bf16 with the served qdq: loss to 1e-2, gradients
    within the served core's own rounding sensitivity (_check_model)."""
    _run_clean("tiny = ModelConfig.preset('tiny')\n"
               "_check_model(dataclasses.replace(tiny, compute_dtype='float32', qdq=False), 2, 45, 1e-6, 1e-4)\n"
               "_check_model(tiny, 2, 45, 1e-2, None)")


@pytest.mark.timeout(1800)
def test_blocked_training_step_equals_served_default_model():
    """The default model's training config (training.train_default.model_config: window 128, top-128), T = 320:
    the window wraps, a partial last block, 160 / 320 compressed entries > top-k. f32 without qdq: loss 1e-6,
    each leaf 1e-3 and all leaves 1e-4 relative L2 (seen: wo_a 1.1e-4, all 1.3e-5); bf16 + qdq as _check_model."""
    _run_clean("_check_model(model_config(compute_dtype='float32', qdq=False), 1, 320, 1e-6, 1e-3)\n"
               "_check_model(model_config(), 1, 320, 1e-2, None)")
