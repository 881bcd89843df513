"""The DSpark draft (dsv41_jax/dspark.py): rings, propose vs the dense reference, sampling, backbone features,
checkpoint names. Parity with the official reference: tools/official_parity/compare_dspark.py (needs torch; run
here when DSV41_TORCH_PYTHON names a Python with torch and the official files are in place)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.hf_layout import stored_tensors
from dsv41_jax import dspark, model, paths
from dsv41_jax.config import ModelConfig
from dsv41_jax.params import init_params

ROOT = Path(__file__).resolve().parents[1]


_write = jax.jit(dspark.write_context, static_argnums=0)
_propose = jax.jit(dspark.propose, static_argnums=0)
_dense = jax.jit(dspark.propose_dense, static_argnums=0)


@pytest.fixture(scope="module")
def f32():
    """tiny in f32 compute (the ring path and the dense reference then differ only by summation order)."""
    cfg = ModelConfig.preset("tiny", compute_dtype="float32")
    return cfg, jax.jit(lambda: init_params(cfg, 3))()


def _features(cfg, B, n, seed):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, n, len(cfg.dspark_target_layer_ids) * cfg.dim)),
                       jnp.float32).astype(jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32)


def test_write_context_keeps_latest_valid_rows(f32):
    cfg, params = f32
    B, W, N = 2, cfg.window_size, 20
    n = W + 5  # wraps the ring
    x = _features(cfg, B, N, 0)
    pos = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    valid = (pos < n).at[1, n - 3:].set(False)  # row 1: its last 3 rows are rejected
    x = x.at[1, n - 3:].set(jnp.nan)  # poison: a rejected row must never reach the ring
    rings = _write(cfg, params, dspark.DraftRings.init(cfg, B), x, pos, valid)
    ctx = np.asarray(jax.jit(dspark.context_kv, static_argnums=0)(cfg, params, x, pos))  # [S, B, N, d]
    assert np.isfinite(np.asarray(rings.kv)).all()
    for b, last in ((0, n - 1), (1, n - 4)):
        want = np.arange(last - W + 1, last + 1)
        got = np.asarray(rings.pos[b])
        assert sorted(got) == list(want) and all(got[p % W] == p for p in want)
        for p in want:
            np.testing.assert_array_equal(np.asarray(rings.kv[:, b, p % W]), ctx[:, b, p])
    # a later write replaces only the slots of its valid rows
    again = _write(cfg, params, rings, x, pos + n, pos == 0)
    assert int(again.pos[0, n % W]) == n and int(again.pos[0, (n + 1) % W]) == int(rings.pos[0, (n + 1) % W])
    sub = again.take(jnp.array([1]))
    back = again.clear(jnp.array([0])).put(jnp.array([0]), sub)
    np.testing.assert_array_equal(np.asarray(back.pos[0]), np.asarray(again.pos[1]))


@pytest.mark.parametrize("n", [5, 20])  # ring still filling / wrapped (one shape: rows past n are not valid)
def test_propose_matches_dense_reference(f32, n):
    cfg, params = f32
    B, N = 2, 20
    x = _features(cfg, B, N, n)
    pos = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    valid = pos < n
    rings = _write(cfg, params, dspark.DraftRings.init(cfg, B), x, pos, valid)
    anchor = jnp.array([7, 300], jnp.int32)
    at = jnp.full((B,), n, jnp.int32)
    key = jax.random.key(1)
    got = _propose(cfg, params, rings, anchor, at, key, jnp.zeros(B))
    ref = _dense(cfg, params, x, pos, valid, anchor, at, key, jnp.zeros(B))
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(got.confidence), np.asarray(ref.confidence), rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    # greedy: each token is the argmax of its logits (one-hot probabilities), and position i's Markov bias is
    # that of token i-1 (the anchor at i = 0)
    lg = np.asarray(got.logits)
    np.testing.assert_array_equal(np.asarray(got.tokens), lg.argmax(-1))
    np.testing.assert_array_equal(np.asarray(got.probs), np.eye(cfg.vocab_size)[lg.argmax(-1)])
    prev = np.concatenate([np.asarray(anchor)[:, None], np.asarray(got.tokens)[:, :-1]], 1)
    bias = np.asarray(dspark.markov(cfg, params, jnp.asarray(prev))[0])
    nobias = np.asarray(_dense(cfg, params, x, pos, valid, anchor, at, key, jnp.zeros(B)).logits) - bias
    assert np.abs(nobias - nobias[:, :, :1]).max() > 0  # the bias is not a constant shift
    if n > cfg.window_size:  # a stale slot (a position at or after the anchor) is ignored
        stale = dspark.DraftRings(rings.kv, rings.pos.at[:, 0].set(n + 3))
        moved = _propose(cfg, params, stale, anchor, at, key, jnp.zeros(B))
        assert not np.allclose(np.asarray(moved.logits), lg)  # slot 0 held a real context position before


def test_sampling_follows_the_returned_distribution():
    cfg = ModelConfig.preset("tiny")
    params = jax.jit(lambda: init_params(cfg, 0))()
    B, k, V = 6000, 2, cfg.vocab_size
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, k, cfg.dim)), jnp.bfloat16)
    logits = jnp.asarray(rng.normal(size=(1, k, V)) * 2, jnp.float32)
    x, logits = jnp.broadcast_to(x, (B, k, cfg.dim)), jnp.broadcast_to(logits, (B, k, V))
    anchor = jnp.full((B,), 5, jnp.int32)
    temp = jnp.full((B,), 0.8).at[0].set(0.0)
    p = jax.jit(dspark.sample_block, static_argnums=(0, 7))(cfg, params, x, logits, anchor, jax.random.key(2), temp,
                                                             True)
    q = np.asarray(p.probs[1, 0])
    np.testing.assert_allclose(q, np.asarray(jax.nn.softmax(p.logits[1, 0] / 0.8)), rtol=1e-5, atol=1e-7)
    emp = np.bincount(np.asarray(p.tokens[1:, 0]), minlength=V) / (B - 1)
    assert 0.5 * np.abs(emp - q).sum() < 0.06  # total variation of 6000 draws
    assert int(p.tokens[0, 0]) == int(np.argmax(np.asarray(p.logits[0, 0])))  # the greedy row
    # position 1's Markov bias follows each row's own drawn token
    bias, _ = dspark.markov(cfg, params, p.tokens[:, 0])
    np.testing.assert_allclose(np.asarray(p.logits[:, 1]), np.asarray(logits[:, 1] + bias), rtol=1e-6)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny")
    return cfg, jax.jit(lambda: init_params(cfg, 0))()


def test_step_features(tiny):
    cfg, params = tiny
    B, T = 2, 12
    toks = np.random.default_rng(4).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    ids = paths.engram_ids(cfg, toks)
    st = model.init_state(cfg, B, 64)
    kw = dict(fresh=True, n_dec=T, n_logits=1)
    full = model.step(cfg, params, st, model.ChunkInputs.make(toks, ids), features=True, **kw)
    plain = jax.eval_shape(lambda: model.step_impl(cfg, params, st, model.ChunkInputs.make(toks, ids), **kw))
    assert plain.features is None  # nothing computed unless asked
    f = full.features
    assert f.x.shape == (B, T, 3 * cfg.dim) and np.isfinite(np.asarray(f.x, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(f.pos), np.broadcast_to(np.arange(T), (B, T)))
    # CED: the decoder's 4 rows end at each sequence's last valid row (row 1 has 2 padding rows)
    nv = jnp.array([T, T - 2], jnp.int32)
    ced = model.step(cfg, params, st, model.ChunkInputs.make(toks, ids, n_valid=nv), fresh=True, n_dec=4,
                     n_logits=1, features=True).features
    for b, n in enumerate((T, T - 2)):
        np.testing.assert_array_equal(np.asarray(ced.pos[b]), np.arange(n - 4, n))
        # layer 3 is in the encoder band, which CED does not change: identical to the full forward's rows
        np.testing.assert_array_equal(np.asarray(ced.x[b, :, :cfg.dim]), np.asarray(f.x[b, n - 4:n, :cfg.dim]))
    assert bool(ced.valid.all())
    # decode: the features of one new row equal the full forward's at that position (the exact decoder); the
    # prefill is the same program as `full`, its last row padding
    pf = model.step(cfg, params, st, model.ChunkInputs.make(toks, ids, n_valid=T - 1), features=True, **kw)
    assert not bool(pf.features.valid[0, -1]) and bool(pf.features.valid[0, -2])
    dec = model.step(cfg, params, pf.state, model.ChunkInputs.make(toks[:, T - 1:], ids[:, T - 1:], pos0=T - 1),
                     fresh=False, n_dec=1, n_logits=1, features=True).features
    np.testing.assert_allclose(np.asarray(dec.x[:, 0], np.float32), np.asarray(f.x[:, T - 1], np.float32),
                               rtol=2e-2, atol=2e-2)
    assert int(dec.pos[0, 0]) == T - 1


def test_checkpoint_names():
    shapes = {s.name: s.shape for s in stored_tensors(ModelConfig.preset("full")) if s.name.startswith("mtp.")}
    mtp = list(shapes)
    assert sum(n.endswith(".ffn.experts.0.w1.weight") for n in mtp) == 3
    assert sum(".ffn.experts." in n and n.endswith(".w2.weight") for n in mtp) == 3 * 128
    for n in ("mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
              "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
              "mtp.2.confidence_head.proj.weight", "mtp.1.attn.wkv.scale", "mtp.1.hc_ffn_fn"):
        assert n in mtp, n
    assert "mtp.0.norm.weight" not in mtp and "mtp.2.main_proj.weight" not in mtp
    assert shapes["mtp.0.main_proj.weight"] == (5120, 3 * 5120)
    assert shapes["mtp.2.markov_head.embed.weight"] == (129280, 256)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, 5120 + 256)
    assert shapes["mtp.0.ffn.gate.weight"] == (128, 5120)
    assert not any(s.name.startswith("mtp.") for s in stored_tensors(ModelConfig.preset("tiny", n_mtp_layers=0)))


@pytest.mark.skipif(not os.environ.get("DSV41_TORCH_PYTHON")
                    or not (ROOT / "tools" / "official_parity" / "official" / "model.py").exists(),
                    reason="needs DSV41_TORCH_PYTHON and the official reference files (tools/official_parity)")
def test_parity_with_official_forward_spec():
    out = subprocess.run([sys.executable, "-c", (
        "from tools.official_parity import compare_dspark as c; import sys, json; "
        f"sys.argv = ['x', '--python', {os.environ['DSV41_TORCH_PYTHON']!r}, '--seq', '14', '--spec-from', '3', "
        "'11']; print('RESULT', json.dumps(c.main()['runs']))")], cwd=ROOT, capture_output=True, text=True, check=True)
    import json

    runs = json.loads(out.stdout.split("RESULT", 1)[1])
    for r in runs.values():
        assert r["tokens_agree"] == 1.0 and r["argmax_agree"] == 1.0
        assert r["logits_rel_err"] < 1e-2 and r["confidence_max_abs"] < 1e-2
