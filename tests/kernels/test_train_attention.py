"""The fused training attention (pallas_kernels.train_attention, the "flash" training form) against its one jnp
reference, dsv41_jax.train_attention.blocked_attention: forward output and the gradients w.r.t. q, chunk_kv,
the latents and the sink (jax.grad of a random-weighted sum of the outputs), interpret mode on CPU, every kernel
output poisoned (NaN) before the call; and the Triton lowering for the H200. The whole training step with
attention="flash": tests/test_training_attention.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import ops
from dsv41_jax.config import ModelConfig
from dsv41_jax.train_attention import blocked_attention
from pallas_kernels import common
from pallas_kernels.train_attention import flash_train_attention

INTERPRET = jax.default_backend() == "cpu"  # on a GPU (JAX_PLATFORMS=cuda) the kernels run compiled


def _case(cfg, *, B, T, H, d, C, k, clip, pos0, seed, empty_rows=0):
    """Random operands of one fresh chunk: q [B,T,H,d] (2 x normal), chunk_kv, latents [B,C,d] (C = 0: an
    SWA-only layer), distinct sorted top-k ids with 20% -1, sink [H]. empty_rows: sequence 1's first rows
    select nothing (with clip[1] > pos0[1] + empty_rows they see no key at all: only the sink)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    dt = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32
    q = (2 * jax.random.normal(ks[0], (B, T, H, d), jnp.float32)).astype(dt)
    kv = jax.random.normal(ks[1], (B, T, d), jnp.float32).astype(dt)
    lat = sel = None
    if C:
        lat = jax.random.normal(ks[2], (B, C, d), jnp.float32).astype(dt)
        sel = jnp.sort(jnp.argsort(jax.random.uniform(ks[3], (B, T, C)), axis=-1)[..., :k], axis=-1)
        sel = jnp.where(jax.random.bernoulli(ks[4], 0.2, sel.shape), -1, sel).astype(jnp.int32)
        sel = sel.at[1, :empty_rows].set(-1)
    sink = jax.random.normal(ks[5], (H,), jnp.float32)
    a = ops.AttentionOperands(q=q, chunk_kv=kv, pos0=jnp.asarray(pos0, jnp.int32), clip=jnp.asarray(clip, jnp.int32),
                              sel=sel, sink=sink, layer=jnp.asarray(0, jnp.int32), src=jnp.asarray(0, jnp.int32),
                              ratio=1, fresh=True)
    return a, lat


def _flash(cfg, a, lat):
    """The kernel as flash_attention calls it, with every kernel output poisoned before the call."""
    return flash_train_attention(a.q, a.chunk_kv, lat, a.sel, a.sink, a.pos0, a.clip, window=cfg.window_size,
                                 scale=a.q.shape[-1] ** -0.5, round_p=cfg.compute_dtype == "bfloat16",
                                 interpret=INTERPRET, _poison_out=True)


TINY = ModelConfig.preset("tiny")
F32_CFG = dataclasses.replace(TINY, compute_dtype="float32", window_size=128)
BF16_CFG = dataclasses.replace(TINY, compute_dtype="bfloat16", window_size=128)

CASES = {
    # f32: 8 heads, T = 200 (not a multiple of the blocks), C = 96 (padded to the latent block), a clip on
    # sequence 1 with pos0 > 0, whose first rows select nothing and see no band entry (sink only: output 0)
    "f32_clip_empty_rows": (F32_CFG, dict(B=2, T=200, H=8, d=64, C=96, k=16, clip=[0, 45], pos0=[0, 5],
                                          empty_rows=40), 2e-5),
    # bf16: 3 heads (padded to 4), d = 48 (padded to 64), 128 latents, top-32
    "bf16_pad_heads_dim": (BF16_CFG, dict(B=2, T=256, H=3, d=48, C=128, k=32, clip=[0, 0], pos0=[0, 0]), 2e-2),
    # bf16 SWA-only layer (no latents), 1 head, a clip
    "bf16_swa_only": (BF16_CFG, dict(B=2, T=256, H=1, d=64, C=0, k=0, clip=[70, 0], pos0=[0, 0]), 2e-2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flash_matches_blocked(name):
    """Output and gradients (q, chunk_kv, lat, sink) to tol x max|reference| (f32: summation order; bf16: P is
    rounded to bf16 against the running max instead of the final one, and dS / P enter the backward's GEMMs in
    bf16)."""
    cfg, kw, tol = CASES[name]
    a, lat = _case(cfg, seed=len(name), **kw)
    want = blocked_attention(cfg, a, lat).astype(jnp.float32)
    got = _flash(cfg, a, lat).astype(jnp.float32)
    assert got.shape == want.shape and bool(jnp.all(jnp.isfinite(got)))
    assert float(jnp.max(jnp.abs(want))) > 0.1
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol * float(jnp.max(jnp.abs(want))), rtol=0)
    if kw.get("empty_rows"):  # sequence 1's rows before the clip see nothing: exactly 0
        n = kw["clip"][1] - kw["pos0"][1]
        assert float(jnp.max(jnp.abs(got[1, :n]))) == 0.0 and float(jnp.max(jnp.abs(want[1, :n]))) == 0.0
    w = jax.random.normal(jax.random.PRNGKey(9), want.shape, jnp.float32)

    def loss(core, q, kv, lat, sink):
        return jnp.sum(core(cfg, dataclasses.replace(a, q=q, chunk_kv=kv, sink=sink), lat).astype(jnp.float32) * w)

    argnums = (0, 1, 2, 3) if lat is not None else (0, 1, 3)
    args = (a.q, a.chunk_kv, lat, a.sink)
    gw = jax.grad(lambda *x: loss(blocked_attention, *x), argnums=argnums)(*args)
    gg = jax.grad(lambda *x: loss(_flash, *x), argnums=argnums)(*args)
    for i, x, y in zip(argnums, gg, gw):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.shape == y.shape and np.all(np.isfinite(x)), i
        assert np.max(np.abs(y)) > 0, i
        np.testing.assert_allclose(x, y, atol=tol * np.max(np.abs(y)), rtol=0, err_msg=f"gradient {i}")


def test_flash_lowers_for_h200():
    """Forward and backward lower through the Pallas Triton backend (bf16 with latents, f32 SWA-only)."""
    B, T, H, d, C, k = 2, 256, 4, 64, 128, 16
    S = jax.ShapeDtypeStruct
    for dt, with_lat in ((jnp.bfloat16, True), (jnp.float32, False)):
        def f(q, kv, lat, sel, sink, pos0, clip, dt=dt, with_lat=with_lat):
            def g(q, kv, lat, sink):
                o = flash_train_attention(q, kv, lat if with_lat else None, sel, sink, pos0, clip, window=128,
                                          scale=d ** -0.5, round_p=dt == jnp.bfloat16, interpret=False)
                return jnp.sum(o.astype(jnp.float32))
            return jax.grad(g, argnums=(0, 1, 2, 3))(q, kv, lat, sink)

        text = common.lower_for_h200(f, S((B, T, H, d), dt), S((B, T, d), dt), S((B, C, d), dt),
                                     S((B, T, k), jnp.int32), S((H,), jnp.float32), S((B,), jnp.int32),
                                     S((B,), jnp.int32))
        assert text.count("__gpu$xla.gpu.triton") == (4 if with_lat else 3)
