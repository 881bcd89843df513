"""DSpark, V4.1's speculative draft (the checkpoint's ``mtp.*`` stages), as pure functions over the parameter tree.

Numerically the official reference (inference/model.py: `DSparkBlock`, `DSparkAttention`, `DSparkMarkovHead`,
`DSparkConfidenceHead`, `Transformer.forward_spec`), built from this package's layers (mHC, sqrtsoftplus MoE, FP8
linears with activation qdq, RoPE, the sink attention with its 64-entry online softmax):

1. Features (backbone side, `model.step(..., features=True).features`, a `model.DraftFeatures`): for every row
   the decoder ran on, the residual entering each `cfg.dspark_target_layer_ids` layer (after its Engram),
   averaged over the hc copies and concatenated: x [B, R, n_targets*D], with the rows' positions and validity.
2. Context (`write_context`): main_x = main_norm(main_proj(x)); every stage turns main_x into a context K/V
   with its own wkv / kv_norm / RoPE at the row's position / FP8 qdq and writes it into its ring slot
   position % W. Only rows with valid=True write (rejected drafts and padding never do); a slot keeps the
   latest position written to it.
3. Block (`propose`): tokens [anchor, noise x (k-1)] at positions pos .. pos+k-1, embedded with the backbone's
   embedding and repeated over the hc copies (identity pre-mix), through the n_mtp_layers stages: full V4
   blocks (mHC, SWA-only attention, MoE with cfg.draft_experts) whose attention is NOT causal: every block
   query reads the ring's valid slots (positions pos-W .. pos-1, listed in slot order as the reference) plus all
   k block keys, with the attention sink.
4. Head: hc_pre with the last stage's FFN pre-mix, `norm`, the backbone's fp32 LM head: one logit row per block
   position. Tokens are drawn left to right: logits[i] += markov_head.head(markov_head.embed(prev)) (prev = the
   anchor at i = 0, then the token just drawn), then argmax (temperature 0) or a Gumbel-max draw at
   logits / temperature. The draft distribution of each position (what lossless rejection sampling needs) is
   softmax(logits[i] / T), one-hot at T = 0 (vLLM's greedy draft).
5. Confidence: confidence_head.proj([hc_pre output ; markov embed of prev]) in f32, a raw logit per position
   (sigmoid: vLLM's per-position acceptance estimate).

API for the engine (cfg and k static; everything jittable; `params` is the model's tree, which holds the draft
under params["mtp"] when cfg.has_draft):

    rings = DraftRings.init(cfg, batch)       # per-sequence state; a pool is the same type with B = pool rows
    sub = rings.take(rows); rings = rings.put(rows, sub); rings = rings.clear(rows)
    rings = write_context(cfg, params, rings, feats.x, feats.pos, feats.valid)      # [B, n, nt*D], [B, n], [B, n]
    prop = propose(cfg, params, rings, anchor, pos, key, temperature, k=5)          # anchor [B] at position pos [B]
    prop.tokens [B, k] int32 · prop.probs [B, k, V] f32 · prop.logits [B, k, V] f32 · prop.confidence [B, k] f32

A decode step of the engine: target forward (features for its rows) -> write_context(valid = accepted rows,
i.e. every position whose input token is final) -> propose(anchor = the token the target just produced, pos =
its position). The rings need the context of positions pos-W .. pos-1: after a CED prefill the decoder rows (the
last W rows of the prompt) seed them; a prompt whose last chunk had fewer decoder rows seeds fewer slots (the
draft then reads less context, nothing breaks). `propose` ignores slots whose position is not in
[pos - W, pos), so stale slots after a preemption are harmless; `clear` empties a row for a new request.

`propose_dense` is the dense reference (plain f32 softmax attention, context K/V computed from the features
directly, no ring), the oracle of the tests. Training (training/train_dspark.py) runs the same stages on many
anchors at once through `block_logits(..., attend=...)` with a dense windowed attention (`attend_windowed`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41_jax import attention, layers, ops, quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.rope import apply_rope, layer_freqs

F32 = jnp.float32
MASKED = -1e30  # the dense paths' masked score: finite, so no inf - inf reaches a gradient


def _pytree(cls):
    return jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in fields(cls)], meta_fields=[])


# ----------------------------------------------------------------------------- state
@_pytree
@dataclass(frozen=True)
class DraftRings:
    """Every stage's 128-slot (cfg.window_size) context ring, one per sequence (or pool row)."""
    kv: jax.Array  # [S, B, W, head_dim] compute dtype: context K/V (RoPE'd, FP8-qdq'd); slot = position % W
    pos: jax.Array  # [B, W] int32 position held by each slot (-1: empty); all stages are written together

    @staticmethod
    def init(cfg: ModelConfig, batch: int) -> DraftRings:
        W = cfg.window_size
        return DraftRings(jnp.zeros((cfg.n_mtp_layers, batch, W, cfg.head_dim), layers.cdtype(cfg)),
                          jnp.full((batch, W), -1, jnp.int32))

    def take(self, rows) -> DraftRings:
        """The rings of pool rows `rows` [b] (a batch view of a pool)."""
        return DraftRings(self.kv[:, rows], self.pos[rows])

    def put(self, rows, sub: DraftRings) -> DraftRings:
        """This pool with rows `rows` [b] replaced by `sub` (rows outside the pool are dropped)."""
        return DraftRings(self.kv.at[:, rows].set(sub.kv, mode="drop"), self.pos.at[rows].set(sub.pos, mode="drop"))

    def clear(self, rows) -> DraftRings:
        """Rows `rows` emptied (a new request)."""
        return replace(self, pos=self.pos.at[rows].set(-1, mode="drop"))


class Proposal(NamedTuple):
    tokens: jax.Array  # [B, k] int32 the drafted tokens, left to right
    probs: jax.Array | None  # [B, k, V] f32 the distribution each token was drawn from (None: return_probs=False)
    logits: jax.Array  # [B, k, V] f32 the draft logits (Markov bias included, before temperature)
    confidence: jax.Array  # [B, k] f32 raw confidence logits (sigmoid: estimated acceptance probability)


# ----------------------------------------------------------------------------- pieces
def draft_moe_config(cfg: ModelConfig) -> ModelConfig:
    """cfg with the draft stages' expert counts (what layers.moe reads)."""
    e, k = cfg.draft_experts
    if (e, k) == (cfg.n_routed_experts, cfg.n_activated_experts):
        return cfg
    return cfg.replace(n_routed_experts=e, n_activated_experts=k)


def _local(ex: ops.ExecContext) -> ops.ExecContext:
    """The draft is small and replicated: it runs without the mesh of a tensor-parallel context."""
    return ex if ex.parallel is None else replace(ex, mesh=None, parallel=None)


def _stage(dp, s):
    return jax.tree.map(lambda a: a[s], dp["layers"])


def _kv(cfg, ex, ap, x, pos, freqs):
    """The attention's K/V (= the latent): kv_norm(wkv x), RoPE at pos, FP8 qdq (as the reference's act_quant)."""
    kv = layers.rms_norm(cfg, ops.linear(ex, cfg, ap["wkv"], x), ap["kv_norm"])
    kv = apply_rope(kv, pos, freqs)
    return quant.fp8_qdq(kv, 32) if cfg.qdq else kv


def context_kv(cfg: ModelConfig, params, x, pos, ex: ops.ExecContext = ops.DEFAULT):
    """Every stage's context K/V [S, ..., d] of feature rows x [..., n_targets*D] at positions pos [...]."""
    ex = _local(ex)
    dp = params["mtp"]
    main_x = layers.rms_norm(cfg, ops.linear(ex, cfg, dp["main_proj"], x.astype(layers.cdtype(cfg))),
                             dp["main_norm"]["weight"])
    freqs = jnp.asarray(layer_freqs(cfg, 0))
    return jnp.stack([_kv(cfg, ex, _stage(dp, s)["attn"], main_x, pos, freqs) for s in range(cfg.n_mtp_layers)])


def write_context(cfg: ModelConfig, params, rings: DraftRings, x, pos, valid,
                  ex: ops.ExecContext = ops.DEFAULT) -> DraftRings:
    """Append the context K/V of feature rows x [B, n, n_targets*D] at positions pos [B, n] where valid [B, n]
    to every stage's ring. Each slot takes the highest-position valid row mapping to it (else keeps its value)."""
    W = cfg.window_size
    kv = context_kv(cfg, params, x, pos, ex)  # [S, B, n, d]
    slot = jnp.mod(pos, W)
    match = valid[:, None, :] & (slot[:, None, :] == jnp.arange(W)[None, :, None])  # [B, W, n]
    best = jnp.argmax(jnp.where(match, pos[:, None, :], -1), axis=-1)  # [B, W]
    has = jnp.any(match, axis=-1)
    new = jnp.take_along_axis(kv, best[None, :, :, None], axis=2)
    return DraftRings(jnp.where(has[None, ..., None], new.astype(rings.kv.dtype), rings.kv),
                      jnp.where(has, jnp.take_along_axis(pos, best, axis=1), rings.pos))


def block_tokens(cfg: ModelConfig, anchor, k: int):
    """[anchor, noise x (k-1)] [..., k] int32."""
    noise = jnp.full((*anchor.shape, k - 1), cfg.dspark_noise_token_id, jnp.int32)
    return jnp.concatenate([anchor[..., None].astype(jnp.int32), noise], axis=-1)


def block_logits(cfg: ModelConfig, params, tokens, bpos, attend, ex: ops.ExecContext = ops.DEFAULT):
    """The stages and the LM head on blocks tokens [R, k] at positions bpos [R, k].

    attend(s, q [R,k,H,d], kv [R,k,d], sink [H]) -> [R,k,H,d] is stage s's attention core (the context it reads
    is the caller's). Returns (head hidden x [R,k,D] compute dtype (hc_pre output, before `norm`), logits [R,k,V]
    f32 without the Markov bias)."""
    ex = _local(ex)
    dcfg = draft_moe_config(cfg)
    dp = params["mtp"]
    dt = layers.cdtype(cfg)
    R, k = tokens.shape
    H, d, G = cfg.n_heads, cfg.head_dim, cfg.o_groups
    freqs = jnp.asarray(layer_freqs(cfg, 0))
    h = jnp.take(params["embed"]["weight"], tokens, axis=0).astype(dt)
    h = jnp.repeat(h[:, :, None, :], cfg.hc_mult, axis=2)
    pre = jnp.zeros((R, k, cfg.hc_mult), F32).at[..., 0].set(1.0)
    for s in range(cfg.n_mtp_layers):
        lp = _stage(dp, s)
        ap = lp["attn"]
        a_pre, a_post, a_comb = ops.hc_mixes(ex, cfg, h, lp["hc_attn_fn"], lp["hc_attn_scale"], lp["hc_attn_base"])
        x = layers.rms_norm(cfg, layers.hc_pre(h, pre), lp["attn_norm"])
        qr = layers.rms_norm(cfg, ops.linear(ex, cfg, ap["wq_a"], x), ap["q_norm"])
        q = apply_rope(ops.linear(ex, cfg, ap["wq_b"], qr).reshape(R, k, H, d), bpos, freqs)
        o = attend(s, q, _kv(cfg, ex, ap, x, bpos, freqs), ap["attn_sink"])
        o = apply_rope(o, bpos, freqs, inverse=True)
        o = ops.grouped_out_proj(ex, cfg, ap["wo_a"], o.reshape(R, k, G, -1))
        h = layers.hc_post(ops.linear(ex, cfg, ap["wo_b"], o.reshape(R, k, -1)), h, a_post, a_comb)
        f_pre, f_post, f_comb = ops.hc_mixes(ex, cfg, h, lp["hc_ffn_fn"], lp["hc_ffn_scale"], lp["hc_ffn_base"])
        x = layers.rms_norm(cfg, layers.hc_pre(h, a_pre), lp["ffn_norm"])
        y, _ = ops.moe(ex, dcfg, lp["ffn"], x)
        h, pre = layers.hc_post(y, h, f_post, f_comb), f_pre
    x = layers.hc_pre(h, pre)
    logits = ops.lm_head(ex, layers.rms_norm(cfg, x, dp["norm"]["weight"]), params["head"]["weight"])
    return x, logits


def markov(cfg: ModelConfig, params, prev):
    """The rank-r Markov head of tokens prev [...]: (logit bias [..., V] f32, embedding [..., r])."""
    mh = params["mtp"]["markov_head"]
    e = jnp.take(mh["embed"]["weight"], prev, axis=0)
    return layers.mm(e.astype(F32), mh["head"]["weight"].astype(F32), "...r,vr->...v"), e


def confidence(cfg: ModelConfig, params, x, e):
    """confidence_head.proj([x ; e]) in f32 -> [...] raw logits."""
    w = params["mtp"]["confidence_head"]["proj"]["weight"]
    hid = jnp.concatenate([x.astype(F32), e.astype(F32)], axis=-1)
    return layers.mm(hid, w.astype(F32), "...i,oi->...o")[..., 0]


def _draw(keys, lg, temperature):
    """Greedy where temperature <= 0, else a Gumbel-max draw at lg / T (the reference's `sample`); one key per row."""
    T = jnp.maximum(temperature, 1e-5)[:, None]
    g = jax.vmap(lambda kk: jax.random.gumbel(kk, lg.shape[1:], F32))(keys)
    return jnp.where(temperature > 0, jnp.argmax(lg / T + g, axis=-1), jnp.argmax(lg, axis=-1)).astype(jnp.int32)


def sample_block(cfg: ModelConfig, params, x, logits, anchor, key, temperature, return_probs: bool = True) -> Proposal:
    """Left-to-right drafting over a block's head outputs x [B,k,D], logits [B,k,V] (see the module docstring).
    key: one PRNG key, or one per row [B]; temperature [B] (or a scalar), <= 0 = greedy."""
    B, k = x.shape[:2]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, F32), (B,))
    single = key.ndim == (0 if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else 1)
    keys = jax.random.split(key, B) if single else key
    prev = anchor.astype(jnp.int32)
    toks, lgs, probs, embs = [], [], [], []
    for i in range(k):
        bias, e = markov(cfg, params, prev)
        lg = logits[:, i] + bias
        prev = _draw(jax.vmap(jax.random.fold_in, (0, None))(keys, i), lg, temperature)
        toks.append(prev)
        lgs.append(lg)
        embs.append(e)
        if return_probs:
            soft = jax.nn.softmax(lg / jnp.maximum(temperature, 1e-5)[:, None], axis=-1)
            hard = jax.nn.one_hot(prev, lg.shape[-1], dtype=F32)
            probs.append(jnp.where((temperature > 0)[:, None], soft, hard))
    conf = confidence(cfg, params, x, jnp.stack(embs, axis=1))
    return Proposal(jnp.stack(toks, axis=1), jnp.stack(probs, axis=1) if return_probs else None,
                    jnp.stack(lgs, axis=1), conf)


# ----------------------------------------------------------------------------- serving
def ring_keys(cfg: ModelConfig, rings: DraftRings, s: int, pos, block_kv):
    """The key list of one stage's block queries, in the reference's order: the valid ring slots (positions in
    [pos - W, pos)) in slot order, then the k block keys, then invalid padding. -> keys [B, W+k, d], valid."""
    W = cfg.window_size
    ok = (rings.pos >= 0) & (rings.pos < pos[:, None]) & (rings.pos >= pos[:, None] - W)  # [B, W]
    order = jnp.argsort(jnp.where(ok, 0, 1) * W + jnp.arange(W)[None], axis=-1)  # valid slots first, slot order
    n = jnp.sum(ok, axis=-1)[:, None]
    k = block_kv.shape[1]
    j = jnp.arange(W + k)[None]
    src = jnp.where(j < n, jnp.take_along_axis(order, jnp.minimum(j, W - 1), axis=1),
                    jnp.where(j < n + k, W + j - n, -1))
    store = jnp.concatenate([rings.kv[s], block_kv.astype(rings.kv.dtype)], axis=1)
    return jnp.take_along_axis(store, jnp.maximum(src, 0)[..., None], axis=1), src >= 0


def propose(cfg: ModelConfig, params, rings: DraftRings, anchor, pos, key, temperature, *, k: int | None = None,
            ex: ops.ExecContext = ops.DEFAULT, return_probs: bool = True) -> Proposal:
    """Draft k (static; default cfg.dspark_block_size, the reference's block) tokens after `anchor` [B] (the token
    at position pos [B], whose context pos-W .. pos-1 is in `rings`). See the module docstring."""
    k = k or cfg.dspark_block_size
    bpos = pos[:, None].astype(jnp.int32) + jnp.arange(k, dtype=jnp.int32)[None]
    d = cfg.head_dim

    def attend(s, q, kv, sink):
        keys, valid = ring_keys(cfg, rings, s, pos, kv)
        B = q.shape[0]
        keys = jnp.broadcast_to(keys[:, None], (B, k, *keys.shape[1:]))
        valid = jnp.broadcast_to(valid[:, None], (B, k, valid.shape[-1]))
        return attention.sparse_attention(cfg, q, keys.astype(q.dtype), valid, sink, d ** -0.5)

    x, logits = block_logits(cfg, params, block_tokens(cfg, anchor, k), bpos, attend, ex)
    return sample_block(cfg, params, x, logits, anchor, key, temperature, return_probs)


# ----------------------------------------------------------------------------- dense reference / training
def dense_attention(q, keys, valid, sink, scale):
    """Plain f32 softmax with the sink: q [..., H, d], keys [..., K, d], valid [..., K] -> [..., H, d]."""
    s = jnp.einsum("...hd,...kd->...hk", q.astype(F32), keys.astype(F32), precision=jax.lax.Precision.HIGHEST)
    s = jnp.where(valid[..., None, :], s * scale, MASKED)
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink.astype(F32)[:, None])
    p = jnp.exp(s - m)
    den = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(sink.astype(F32)[:, None] - m)
    o = jnp.einsum("...hk,...kd->...hd", p / den, keys.astype(F32), precision=jax.lax.Precision.HIGHEST)
    return o.astype(q.dtype)


def attend_windowed(cfg: ModelConfig, ctx_kv, ctx_pos, ctx_valid, anchor_pos):
    """A dense `attend` for blocks at many anchors over one shared context (training, `propose_dense`).

    ctx_kv [S, B, T, d] (context_kv of the feature rows), ctx_pos / ctx_valid [B, T]; blocks are [B, N, k] rows
    flattened to R = B*N, anchor_pos [B, N]: block (b, n) reads the context rows of sequence b with position in
    [anchor - W, anchor) plus its own k keys (no causal mask), with the sink, in f32."""
    W = cfg.window_size
    B, N = anchor_pos.shape
    a = anchor_pos[..., None]
    vis = ctx_valid[:, None] & (ctx_pos[:, None] < a) & (ctx_pos[:, None] >= a - W)  # [B, N, T]
    scale = cfg.head_dim ** -0.5

    def attend(s, q, kv, sink):
        k, H, d = q.shape[1:]
        qq = q.reshape(B, N, k, H, d).astype(F32)
        sc = jnp.einsum("bnqhd,btd->bnqht", qq, ctx_kv[s].astype(F32), precision=jax.lax.Precision.HIGHEST)
        sc = jnp.where(vis[:, :, None, None], sc * scale, MASKED)
        kb = kv.reshape(B, N, k, d).astype(F32)
        sb = jnp.einsum("bnqhd,bnjd->bnqhj", qq, kb, precision=jax.lax.Precision.HIGHEST) * scale
        m = jnp.maximum(jnp.maximum(jnp.max(sc, -1), jnp.max(sb, -1)), sink.astype(F32))[..., None]
        pc, pb = jnp.exp(sc - m), jnp.exp(sb - m)
        den = jnp.sum(pc, -1, keepdims=True) + jnp.sum(pb, -1, keepdims=True) + jnp.exp(sink.astype(F32)[:, None] - m)
        o = (jnp.einsum("bnqht,btd->bnqhd", pc, ctx_kv[s].astype(F32), precision=jax.lax.Precision.HIGHEST)
             + jnp.einsum("bnqhj,bnjd->bnqhd", pb, kb, precision=jax.lax.Precision.HIGHEST)) / den
        return o.reshape(B * N, k, H, d).astype(q.dtype)

    return attend


def propose_dense(cfg: ModelConfig, params, x, pos, valid, anchor, anchor_pos, key, temperature, *,
                  k: int | None = None) -> Proposal:
    """The dense reference of write_context + propose: context K/V straight from the feature rows x [B, n, F] at
    pos / valid [B, n] (the W before anchor_pos [B] are read), plain f32 softmax attention, no ring."""
    k = k or cfg.dspark_block_size
    attend = attend_windowed(cfg, context_kv(cfg, params, x, pos), pos, valid, anchor_pos[:, None])
    bpos = anchor_pos[:, None].astype(jnp.int32) + jnp.arange(k, dtype=jnp.int32)[None]
    xh, logits = block_logits(cfg, params, block_tokens(cfg, anchor, k), bpos, attend)
    return sample_block(cfg, params, xh, logits, anchor, key, temperature)
