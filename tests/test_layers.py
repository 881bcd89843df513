"""Building blocks against independent numpy implementations on random inputs."""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import attention as A
from dsv41_jax import layers as L
from dsv41_jax.config import ModelConfig
from dsv41_jax.rope import apply_rope, rope_freqs

BF = ml_dtypes.bfloat16


def np_sparse_attn(q, keys, valid, sink, scale, round_probs):
    """Sequential 64-entry online softmax as the reference kernel (probabilities optionally bf16-rounded)."""
    B, T, H, d = q.shape
    out = np.zeros((B, T, H, d), np.float32)
    for b in range(B):
        for t in range(T):
            m = np.full(H, -1e30, np.float32)
            den = np.zeros(H, np.float32)
            num = np.zeros((H, d), np.float32)
            for s in range(0, keys.shape[2], 64):
                k = keys[b, t, s:s + 64].astype(np.float32)
                ok = valid[b, t, s:s + 64]
                sc = q[b, t].astype(np.float32) @ k.T
                sc = np.where(ok[None], sc, -np.inf) * np.float32(scale)
                nm = np.maximum(m, sc.max(-1))
                corr = np.exp(m - nm)
                p = np.exp(sc - nm[:, None])
                den = den * corr + p.sum(-1)
                pp = p.astype(BF).astype(np.float32) if round_probs else p
                num = num * corr[:, None] + pp @ np.where(ok[:, None], k, 0)
                m = nm
            den = den + np.exp(sink - m)
            out[b, t] = num / den[:, None]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sparse_attention_matches_sequential_reference(dtype):
    cfg = ModelConfig.preset("tiny", compute_dtype=dtype)
    rng = np.random.default_rng(0)
    B, T, H, d, K = 2, 3, 4, 32, 150
    q = rng.standard_normal((B, T, H, d)).astype(np.float32) * 2
    keys = rng.standard_normal((B, T, K, d)).astype(np.float32)
    valid = rng.random((B, T, K)) < 0.7
    sink = rng.standard_normal(H).astype(np.float32)
    if dtype == "bfloat16":
        q, keys = q.astype(BF).astype(np.float32), keys.astype(BF).astype(np.float32)
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    got = A.sparse_attention(cfg, jnp.asarray(q, dt), jnp.asarray(keys, dt), jnp.asarray(valid), jnp.asarray(sink),
                             d ** -0.5)
    ref = np_sparse_attn(q, keys, valid, sink, d ** -0.5, dtype == "bfloat16")
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-6)
    else:  # identical rounding points: at most one bf16 ulp from f32 summation order
        g = np.asarray(got.astype(jnp.float32))
        assert np.mean(g == ref.astype(BF).astype(np.float32)) > 0.97
        np.testing.assert_allclose(g, ref, rtol=2 ** -7, atol=1e-3)
    # the chunked rounding matters: naive softmax with rounded probs differs from the reference emulation
    if dtype == "bfloat16":
        s = np.einsum("bthd,btkd->bthk", q, keys) * d ** -0.5
        s = np.where(valid[:, :, None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        naive = np.einsum("bthk,btkd->bthd", p.astype(BF).astype(np.float32), keys) / (
            p.sum(-1) + np.exp(sink[None, None] - m[..., 0]))[..., None]
        assert not np.allclose(naive, ref, rtol=0, atol=0)


def test_hc_mixes_and_post_match_numpy():
    cfg = ModelConfig.preset("tiny")
    rng = np.random.default_rng(1)
    D, hc = cfg.dim, cfg.hc_mult
    x = rng.standard_normal((3, 5, hc, D)).astype(np.float32)
    fn = rng.standard_normal((24, hc * D)).astype(np.float32) / math.sqrt(hc * D)
    scale = rng.uniform(0.5, 1, 3).astype(np.float32)
    base = rng.standard_normal(24).astype(np.float32)
    pre, post, comb = L.hc_mixes(cfg, jnp.asarray(x), jnp.asarray(fn), jnp.asarray(scale), jnp.asarray(base))
    xf = x.reshape(3, 5, -1).astype(np.float64)
    m = xf @ fn.T.astype(np.float64) / np.sqrt((xf ** 2).mean(-1, keepdims=True) + cfg.norm_eps)
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    eps = cfg.hc_eps
    np.testing.assert_allclose(np.asarray(pre), sig(m[..., :4] * scale[0] + base[:4]) + eps, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(post), 2 * sig(m[..., 4:8] * scale[1] + base[4:8]), rtol=1e-5)
    c = (m[..., 8:] * scale[2] + base[8:]).reshape(3, 5, 4, 4)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    np.testing.assert_allclose(np.asarray(comb), c, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-5)  # ends on a column normalisation
    y = rng.standard_normal((3, 5, D)).astype(np.float32)
    out = L.hc_post(jnp.asarray(y), jnp.asarray(x), post, comb)
    ref = np.asarray(post)[..., None] * y[:, :, None] + np.einsum("bsij,bsid->bsjd", np.asarray(comb), x)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_moe_matches_per_token_loop():
    cfg = ModelConfig.preset("tiny", compute_dtype="float32", qdq=False, weight_format="bf16")
    from dsv41_jax.params import init_params
    p = jax.tree.map(lambda a: a[2], init_params(cfg, 3)["layers"]["ffn"])
    rng = np.random.default_rng(2)
    x = rng.standard_normal((37, cfg.dim)).astype(np.float32)
    got = np.asarray(L.moe(cfg, p, jnp.asarray(x)))
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    s = np.sqrt(np.log1p(np.exp(x @ f(p["gate"]["weight"]).T)))
    idx = np.argsort(-(s + f(p["gate"]["bias"])), axis=-1, kind="stable")[:, :cfg.n_activated_experts]

    def expert(w1, w2, w3, v):
        g, u = v @ w1.T, np.clip(v @ w3.T, -10, 10)
        g = np.minimum(g, 10)
        return (g / (1 + np.exp(-g)) * u) @ w2.T

    e = {k: f(p["experts"][k]["weight"]) for k in ("w1", "w2", "w3")}
    sh = {k: f(p["shared"][k]["weight"]) for k in ("w1", "w2", "w3")}
    ref = np.zeros_like(x, dtype=np.float64)
    for n in range(x.shape[0]):
        w = s[n, idx[n]]
        w = w / w.sum() * cfg.route_scale
        for k, ex in enumerate(idx[n]):
            ref[n] += w[k] * expert(e["w1"][ex], e["w2"][ex], e["w3"][ex], x[n])
        ref[n] += expert(sh["w1"], sh["w2"], sh["w3"], x[n])
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


def test_rope_inverse_and_yarn():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 7, 3, 32)).astype(np.float32))
    pos = jnp.asarray(rng.integers(0, 10 ** 6, (2, 7)))
    fr = rope_freqs(8, 160000.0, 65536, 16.0, 32, 1)
    y = apply_rope(x, pos, fr)
    np.testing.assert_array_equal(np.asarray(y[..., :24]), np.asarray(x[..., :24]))  # only the last 8 rotate
    np.testing.assert_allclose(np.asarray(apply_rope(y, pos, fr, inverse=True)), np.asarray(x), atol=1e-5)
    # YaRN for the full config: dims below `low` keep their frequency, above `high` are divided by 16
    f = rope_freqs(64, 160000.0, 65536, 16.0, 32, 1)
    base = 1.0 / 160000.0 ** (np.arange(0, 64, 2) / 64)
    corr = lambda r: 64 * math.log(65536 / (r * 2 * math.pi)) / (2 * math.log(160000))  # noqa: E731
    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), 63)
    np.testing.assert_allclose(f[:low], base[:low], rtol=1e-6)
    np.testing.assert_allclose(f[high:], base[high:] / 16, rtol=1e-6)
    assert np.all(np.diff(f) < 0)
