"""The V4.1 CED forward over explicit state: one general chunk step, and the three execution paths.

`step` processes T new tokens per sequence (positions pos0[b] .. pos0[b]+T-1) through
  1. the encoder band (layers before the decoder start, all T rows), writing SWA rings and global KV;
  2. the decoder start layer's global-KV build (compressor + index keys) for all T rows;
  3. the decoder band (decoder start .. L-1) on the last `n_dec` rows only;
  4. the fp32 LM head on the last `n_logits` rows.
With n_dec = T this is the plain causal LM; with n_dec = n_win it is the CED prefill (the decoder's SWA is
clipped at `dec_clip`); with T = 1 it is a decode step.

State (dense, one row per sequence; the serving engine keeps the same arrays paged):
  swa [L,B,W,d]                SWA rings (slot = position % W), values already FP8-qdq'd
  comp_kv / comp_score         [n_r2,B,2,d] f32: partial ratio-2 groups of the ratio-2 KV sources
  lat_r{r} [n,B,C,d]           global KV latents of the ratio-r sources (RoPE'd, FP4-qdq'd); C = max_len / r
  idx_r{r} [n,B,C,di]          index keys of the same sources (FP4-qdq'd)
Global-KV writes are skipped for entries whose group starts below `write_from` (a replayed prefix never
rewrites cached KV). SWA reads are clipped at enc_clip / dec_clip (SWA bounded replay, MODEL.md §5).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from dsv41_jax import attention as A
from dsv41_jax import layers as Lyr
from dsv41_jax import quant
from dsv41_jax.config import KIND_IDX, KIND_REUSE, KIND_SRC, KIND_SWA, ModelConfig
from dsv41_jax.kv_cache import DenseKV
from dsv41_jax.params import source_slots
from dsv41_jax.rope import apply_rope, layer_freqs
from dsv41_jax.schedule import Segment, decoder_schedule, encoder_schedule

F32 = jnp.float32


# ----------------------------------------------------------------------------- state
def buffer_len(cfg: ModelConfig, max_len: int, ratio: int) -> int:
    return max(max_len // ratio, 1)


def init_state(cfg: ModelConfig, batch: int, max_len: int | None = None) -> dict:
    max_len = max_len or cfg.max_seq_len
    dt = Lyr.cdtype(cfg)
    _, counts = source_slots(cfg)
    st = {"swa": jnp.zeros((cfg.n_layers, batch, cfg.window_size, cfg.head_dim), dt)}
    for key, n in counts.items():
        if not key.startswith("src"):
            continue
        r = int(key[-1])
        C = buffer_len(cfg, max_len, r)
        st[f"lat_r{r}"] = jnp.zeros((n, batch, C, cfg.head_dim), dt)
        st[f"idx_r{r}"] = jnp.zeros((n, batch, C, cfg.index_head_dim), dt)
        if r > 1:
            st["comp_kv"] = jnp.zeros((n, batch, r, cfg.head_dim), F32)
            st["comp_score"] = jnp.full((n, batch, r, cfg.head_dim), -jnp.inf, F32)
    return st


def _take(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(a, i, v):
    return jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0)


def _topk_width(cfg, kv, state, ratio):
    return min(cfg.index_topk, kv.capacity(state, ratio))


# ----------------------------------------------------------------------------- one layer
def _attention(cfg, seg: Segment, kind, params, lp, l, slot, x, state, shared, ctx, forced):
    B, T, _ = x.shape
    H, d, W = cfg.n_heads, cfg.head_dim, cfg.window_size
    ratio = seg.ratio
    freqs = jnp.asarray(layer_freqs(cfg, ratio))
    qpos, pos0 = ctx["qpos"], ctx["pos0"]
    ap = lp["attn"]
    qr = Lyr.rms_norm(cfg, Lyr.linear(cfg, ap["wq_a"], x), ap["q_norm"])
    q = apply_rope(Lyr.linear(cfg, ap["wq_b"], qr).reshape(B, T, H, d), qpos, freqs)
    kv = apply_rope(Lyr.rms_norm(cfg, Lyr.linear(cfg, ap["wkv"], x), ap["kv_norm"]), qpos, freqs)
    if cfg.qdq:
        kv = quant.fp8_qdq(kv, 32)
    ring = jax.lax.dynamic_index_in_dim(state["swa"], l, keepdims=False)
    wpos = A.window_positions(qpos, ctx["clip"], W, ctx["fresh"])
    widx = A.window_store_index(wpos, pos0, W, ctx["fresh"])
    store = kv if ctx["fresh"] else jnp.concatenate([ring, kv], axis=1)
    keys = jnp.take_along_axis(store, widx.reshape(B, -1)[..., None], axis=1).reshape(B, T, -1, d)
    valid = wpos >= 0
    state = dict(state, swa=_put(state["swa"], l, A.ring_update(ring, kv, pos0, W, ctx["n_valid"])))
    topk = None
    store_kv = ctx["kv"]
    if ratio:
        if kind == KIND_SRC:
            shared = dict(shared, src=jnp.asarray(slot, jnp.int32))
            if not seg.prebuilt:
                state = _build_global(cfg, params, slot, ratio, x, state, ctx)
        src = shared["src"]
        if kind in (KIND_SRC, KIND_IDX):
            ip = _take(params[seg.stack]["indexer"], slot)
            if forced is not None:
                topk = forced
            else:
                index_k = store_kv.index_keys(state, ratio, src)
                scores = A.index_scores(cfg, ip, x, qr, qpos, index_k, ratio, freqs)
                if seg.cand_source:
                    shared = dict(shared, cand=A.candidate_blocks(cfg, scores, qpos, ratio))
                elif seg.uses_cand:
                    scores = A.mask_to_candidates(scores, shared["cand"], cfg.candidate_block_size)
                topk = A.select_topk(cfg, scores, qpos, ratio)
            shared = dict(shared, topk=topk)
        sel = shared["topk"]
        ck = store_kv.latents(state, ratio, src, sel)
        keys = jnp.concatenate([keys, ck.astype(keys.dtype)], axis=2)
        valid = jnp.concatenate([valid, sel >= 0], axis=2)
    o = A.sparse_attention(cfg, q, keys.astype(q.dtype), valid, ap["attn_sink"], d ** -0.5)
    o = apply_rope(o, qpos, freqs, inverse=True)
    G = cfg.o_groups
    wo_a = ap["wo_a"].astype(o.dtype).reshape(G, cfg.o_lora_rank, -1)
    o = Lyr.mm(o.reshape(B, T, G, -1), wo_a, "btgd,grd->btgr").astype(o.dtype)
    return Lyr.linear(cfg, ap["wo_b"], o.reshape(B, T, -1)), state, shared, topk


def _build_global(cfg, params, slot, ratio, x, state, ctx):
    """A KV source's compressor + index keys for this chunk, written into its global buffers."""
    sp = _take(params[f"src_r{ratio}"], slot)
    freqs = jnp.asarray(layer_freqs(cfg, ratio))
    if ratio > 1:
        ck = jax.lax.dynamic_index_in_dim(state["comp_kv"], slot, keepdims=False)
        cs = jax.lax.dynamic_index_in_dim(state["comp_score"], slot, keepdims=False)
    else:
        ck = cs = None
    lat, j, ok, ck, cs = A.compress(cfg, sp["compressor"], x, ctx["qpos"], ctx["pos0"], ctx["n_valid"], ratio,
                                    ck, cs)
    lat, k = A.build_entries(cfg, sp["compressor"], sp["indexer"], lat, j, ratio, freqs)
    ok = ok & (j * ratio >= ctx["write_from"][:, None])
    state = ctx["kv"].write(state, ratio, slot, lat, k, j, ok)
    if ratio > 1:
        state = dict(state, comp_kv=_put(state["comp_kv"], slot, ck), comp_score=_put(state["comp_score"], slot, cs))
    return state


def _block(cfg, seg, kind, params, l, slot, carry, ctx, forced):
    """One transformer block with single-pass mHC (the attention uses the previous block's FFN pre-mix)."""
    h, pre, state, shared = carry
    lp = _take(params["layers"], l)
    a_pre, a_post, a_comb = Lyr.hc_mixes(cfg, h, lp["hc_attn_fn"], lp["hc_attn_scale"], lp["hc_attn_base"])
    x = Lyr.rms_norm(cfg, Lyr.hc_pre(h, pre), lp["attn_norm"])
    o, state, shared, topk = _attention(cfg, seg, kind, params, lp, l, slot, x, state, shared, ctx, forced)
    h = Lyr.hc_post(o, h, a_post, a_comb)
    f_pre, f_post, f_comb = Lyr.hc_mixes(cfg, h, lp["hc_ffn_fn"], lp["hc_ffn_scale"], lp["hc_ffn_base"])
    x = Lyr.rms_norm(cfg, Lyr.hc_pre(h, a_pre), lp["ffn_norm"])
    h = Lyr.hc_post(Lyr.moe(cfg, lp["ffn"], x), h, f_post, f_comb)
    return (h, f_pre, state, shared), topk


def _run_segment(cfg, seg: Segment, params, carry, ctx, engram_ids, forced: dict | None):
    h, pre, state, shared = carry
    if seg.engram_slot >= 0:
        h = Lyr.engram(cfg, params["engram"][seg.engram_slot], h, engram_ids[:, :, seg.engram_slot])
        carry = (h, pre, state, shared)
    n = len(seg.firsts)
    xs = {"first": jnp.asarray(seg.firsts, jnp.int32), "slot": jnp.asarray(seg.slots, jnp.int32)}
    if seg.n_reuse:
        xs["reuse"] = jnp.asarray(seg.reuse, jnp.int32)
    use_forced = forced is not None and seg.is_index_source
    if use_forced:
        xs["forced"] = jnp.stack([forced[l] for l in seg.firsts])

    def group(c, x):
        c, topk = _block(cfg, seg, seg.kind, params, x["first"], x["slot"], c, ctx,
                         x["forced"] if use_forced else None)
        if seg.n_reuse:
            def reuse(c2, l):
                c2, _ = _block(cfg, seg, KIND_REUSE, params, l, 0, c2, ctx, None)
                return c2, None
            c, _ = jax.lax.scan(reuse, c, x["reuse"])
        return c, topk

    carry, topks = jax.lax.scan(group, carry, xs, length=n)
    rec = {}
    if seg.is_index_source:
        rec = {l: topks[i] for i, l in enumerate(seg.firsts)}
    return carry, rec


def _shared_init(cfg, kv, state, B, T, ratio):
    if not ratio:
        return {"topk": jnp.zeros((B, T, 1), jnp.int32), "cand": jnp.zeros((B, T, 1), bool),
                "src": jnp.zeros((), jnp.int32)}
    k = _topk_width(cfg, kv, state, ratio)
    C = kv.capacity(state, ratio)
    nb = -(-C // cfg.candidate_block_size) if cfg.candidate_source_layer >= 0 else 1
    return {"topk": jnp.full((B, T, k), -1, jnp.int32), "cand": jnp.zeros((B, T, nb), bool),
            "src": jnp.zeros((), jnp.int32)}


def _run_band(cfg, segs, params, h, pre, state, ctx, engram_ids, forced):
    B, T = h.shape[:2]
    rec = {}
    shared = None
    ratio = None
    for seg in segs:
        if seg.ratio != ratio or shared is None:
            ratio = seg.ratio
            shared = _shared_init(cfg, ctx["kv"], state, B, T, ratio)
        (h, pre, state, shared), r = _run_segment(cfg, seg, params, (h, pre, state, shared), ctx, engram_ids,
                                                   forced)
        rec.update(r)
    return h, pre, state, rec


def _band_ratio_ok(segs):
    """Within a band, every compressed segment shares one ratio (validated by the config)."""
    return len({s.ratio for s in segs if s.ratio}) <= 1


def step_impl(cfg: ModelConfig, params, state, tokens, engram_ids, pos0, enc_clip, dec_clip, write_from,
              forced_topk=None, n_valid=None, *, fresh: bool, n_dec: int, n_logits: int, kv=None):
    """One chunk step; see the module docstring.

    Rows >= n_valid[b] are padding: they never enter a ring or the global KV. The decoder runs on the
    n_dec rows ending at the last valid row (clamped at row 0), with its SWA clipped at
    max(dec_clip, first decoder position) when n_dec < n_valid. Returns (logits [B, n_logits, V] f32 of the
    last n_logits valid rows, state, top-k per index-source layer {layer: [B, rows, k]})."""
    kv = kv or DenseKV()
    B, T = tokens.shape
    n_valid = jnp.full((B,), T, jnp.int32) if n_valid is None else n_valid
    dt = Lyr.cdtype(cfg)
    qpos = pos0[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    h = jnp.take(params["embed"]["weight"], tokens, axis=0).astype(dt)
    h = jnp.repeat(h[:, :, None, :], cfg.hc_mult, axis=2)
    pre = jnp.zeros((B, T, cfg.hc_mult), F32).at[..., 0].set(1.0)
    ctx = dict(qpos=qpos, pos0=pos0, clip=enc_clip, write_from=write_from, fresh=fresh, n_valid=n_valid, kv=kv)
    enc, dec = encoder_schedule(cfg), decoder_schedule(cfg)
    assert _band_ratio_ok(enc) and _band_ratio_ok(dec)
    h, pre, state, rec = _run_band(cfg, enc, params, h, pre, state, ctx, engram_ids, forced_topk)
    start = jnp.zeros((B,), jnp.int32)
    if dec and n_dec == 0:  # a non-final CED chunk: the encoder band and the decoder's global-KV build only
        l = cfg.decoder_start
        x = Lyr.rms_norm(cfg, Lyr.hc_pre(h, pre), _take(params["layers"], l)["attn_norm"])
        state = _build_global(cfg, params, source_slots(cfg)[0][l][1], cfg.compress_ratios[l], x, state, ctx)
        return None, state, rec
    if dec:
        l = cfg.decoder_start
        lp = _take(params["layers"], l)
        x = Lyr.rms_norm(cfg, Lyr.hc_pre(h, pre), lp["attn_norm"])
        slot = source_slots(cfg)[0][l][1]
        state = _build_global(cfg, params, slot, cfg.compress_ratios[l], x, state, ctx)
        start = jnp.maximum(n_valid - n_dec, 0)
        rows = start[:, None] + jnp.arange(n_dec)[None]
        h = jnp.take_along_axis(h, rows[:, :, None, None], axis=1)
        pre = jnp.take_along_axis(pre, rows[:, :, None], axis=1)
        dpos0 = pos0 + start
        dclip = jnp.maximum(dec_clip, jnp.where(start > 0, dpos0, 0))
        dctx = dict(qpos=qpos[:, :n_dec] + start[:, None], pos0=dpos0, clip=dclip, write_from=write_from,
                    fresh=fresh and n_dec == T, n_valid=n_valid - start, kv=kv)
        dforced = None
        if forced_topk is not None:
            dforced = {k: jnp.take_along_axis(v, jnp.clip(rows, 0, v.shape[1] - 1)[..., None], axis=1)
                       for k, v in forced_topk.items()}
        h, pre, state, rec_d = _run_band(cfg, dec, params, h, pre, state, dctx, None, dforced)
        rec.update(rec_d)
    last = n_valid - start - 1  # last valid row within h
    if n_logits == h.shape[1]:  # every (decoder) row, in order
        rows = jnp.broadcast_to(jnp.arange(n_logits)[None], (B, n_logits))
    else:
        rows = jnp.maximum(last[:, None] - (n_logits - 1) + jnp.arange(n_logits)[None], 0)
    hs = jnp.take_along_axis(h, rows[:, :, None, None], axis=1)
    ps = jnp.take_along_axis(pre, rows[:, :, None], axis=1)
    x = Lyr.rms_norm(cfg, Lyr.hc_pre(hs, ps), params["norm"]["weight"])
    logits = Lyr.mm(x.astype(F32), params["head"]["weight"].astype(F32), "...i,vi->...v")
    return logits, state, rec


step = partial(jax.jit, static_argnames=("cfg", "fresh", "n_dec", "n_logits", "kv"))(step_impl)


def step_args(batch: int, pos0=0, enc_clip=0, dec_clip=0, write_from=0):
    """Per-row int32 arrays for `step` from scalars or sequences."""
    def vec(v):
        return jnp.broadcast_to(jnp.asarray(v, jnp.int32), (batch,))
    return dict(pos0=vec(pos0), enc_clip=vec(enc_clip), dec_clip=vec(dec_clip), write_from=vec(write_from))


KIND_NAMES = {KIND_SWA: "SWA-only", KIND_SRC: "Full", KIND_IDX: "Reindex", KIND_REUSE: "Reuse"}
