"""training/train_dspark.py and training/dspark_eval.py on the tiny preset: a few training steps lower the loss,
the QAT view serves what the export serves, and the measured speculative decoding reproduces greedy decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import dspark
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.params import init_params
from training import objective as T
from training import train_dspark as TD
from training.dspark_eval import SpecEval


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.preset("tiny")
    cfg_b = cfg.replace(n_mtp_layers=0, dspark_block_size=0)
    backbone = {k: v for k, v in jax.jit(lambda: init_params(cfg, 0))().items() if k != "mtp"}
    masters = jax.jit(lambda b: TD.init_draft_masters(cfg, T.masters_from_params(cfg_b, b), 0))(backbone)
    return cfg, backbone, masters


def test_init_from_backbone(setup):
    cfg, backbone, masters = setup
    src = T.masters_from_params(cfg.replace(n_mtp_layers=0, dspark_block_size=0), backbone)["layers"]
    L, S, E = cfg.n_layers, cfg.n_mtp_layers, cfg.draft_experts[0]
    np.testing.assert_array_equal(np.asarray(masters["layers"]["attn"]["wkv"]["weight"]),
                                  np.asarray(src["attn"]["wkv"]["weight"][L - S:]))
    np.testing.assert_array_equal(np.asarray(masters["layers"]["ffn"]["experts"]["w2"]["weight"]),
                                  np.asarray(src["ffn"]["experts"]["w2"]["weight"][L - S:, :E]))
    assert not np.asarray(masters["markov_head"]["head"]["weight"]).any()


def test_training_steps_lower_the_loss(setup):
    cfg, backbone, masters = setup
    h = T.Hyper(peak_lr=3e-3)
    tx = T.make_optimizer(h, masters)
    opt = tx.init(masters)
    B, Tn, N = 2, 24, 6
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, Tn)), jnp.int32)
    hasher = EngramHasher(cfg)
    ids = jnp.asarray(hasher.hash_ids(np.asarray(tokens)))
    tlogits, feats = jax.jit(lambda p, t, i: TD.backbone_forward(cfg, p, t, i))(backbone, tokens, ids)
    anchors = jnp.asarray(np.sort(rng.integers(1, Tn - cfg.dspark_block_size + 1, (B, N)), 1), jnp.int32)
    step = jax.jit(TD.make_step(cfg, h, tx))
    losses = []
    for _ in range(6):
        masters, opt, met = step(masters, opt, backbone, tokens, feats.x, tlogits, anchors, jnp.float32(3e-3))
        losses.append(float(met["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] * 0.9, losses
    assert met["top1"].shape == (cfg.dspark_block_size,)
    # the QAT view (training) and the export (served) give the same draft, bit for bit
    q = TD.draft_params(cfg, backbone, masters, qat=True)
    e = TD.draft_params(cfg, backbone, masters, qat=False)
    rings = dspark.DraftRings.init(cfg, B)
    pos = jnp.broadcast_to(jnp.arange(Tn, dtype=jnp.int32), (B, Tn))

    def run(p):
        r = dspark.write_context(cfg, p, rings, feats.x, pos, pos < 10)
        return dspark.propose(cfg, p, r, tokens[:, 10], jnp.full((B,), 10, jnp.int32), jax.random.key(0),
                              jnp.zeros(B)).logits

    np.testing.assert_array_equal(np.asarray(jax.jit(run)(q)), np.asarray(jax.jit(run)(e)))


def test_speculative_decoding_equals_greedy(setup):
    cfg, backbone, masters = setup
    params = TD.draft_params(cfg, backbone, masters, qat=False)
    B, Tn = 2, 40
    ev = SpecEval(cfg, EngramHasher(cfg), B, Tn)
    prompts = np.random.default_rng(1).integers(3, cfg.vocab_size, (B, 12)).astype(np.int32)
    n_new = Tn - 12 - 2 * cfg.dspark_block_size - 2
    r = ev.run(params, prompts, n_new)
    np.testing.assert_array_equal(r["tokens"], ev.greedy(params, prompts, n_new))
    assert r["steps"] > 0 and len(r["per_position"]) == cfg.dspark_block_size
    assert all(a >= b for a, b in zip(r["per_position"], r["per_position"][1:]))
    assert r["mean_accepted_length"] == 1 + r["accepted_drafts"] / r["steps"]
