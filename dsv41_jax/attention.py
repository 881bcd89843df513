"""CSA2 attention pieces (docs/ARCHITECTURE.md; the layer wiring: dsv41_jax.model): the sparse gather attention
with an attention sink, the sliding-window index lists (with the replay clip), the compressor, the lightning
indexer, the layer-20 candidate-block filter and the top-k selections (the one home of those rules: the Pallas
branch of the ops seam uses the id forms here too).

Numerics follow the reference kernels:
- scores are q·k in f32 then times 512^-0.5; the softmax runs online over 64-entry chunks of the index list
  and the unnormalised probabilities are rounded to bf16 before P·V (emulated exactly: the running max at each
  chunk is a cumulative max, so the chunk ordering of the list matters and is kept as the reference's);
- indexer scores are a bf16 einsum, ReLU, times bf16 weights, summed over heads (f32 accumulation, bf16 result);
- every top-k breaks ties lower-index-first (lax.top_k), then the picks are re-sorted by position and the
  unreachable ones (position >= (t+1)//ratio) become -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.layers import F32, cdtype, dense, linear, mm, rms_norm
from dsv41_jax.rope import apply_rope
from dsv41_jax.weights import materialize

NEG_INF = float("-inf")
SOFTMAX_CHUNK = 64


# ----------------------------------------------------------------------------- sparse attention
def sparse_attention(cfg, q, keys, valid, sink, scale):
    """q [B,T,H,d], keys [B,T,K,d] (gathered per query), valid [B,T,K], sink [H] -> [B,T,H,d].

    out_h = sum_j e^{s_hj-m} v_j / (sum_j e^{s_hj-m} + e^{sink_h-m}), K = V = the same latent.
    """
    B, T, K, d = keys.shape
    keys = jnp.where(valid[..., None], keys, 0)  # never let an unused (possibly stale) slot into P.V
    s = mm(q, keys, "bthd,btkd->bthk")
    s = jnp.where(valid[:, :, None, :], s, NEG_INF) * scale
    pad = -K % SOFTMAX_CHUNK
    if pad:
        s = jnp.pad(s, [(0, 0)] * 3 + [(0, pad)], constant_values=NEG_INF)
        keys = jnp.pad(keys, [(0, 0), (0, 0), (0, pad), (0, 0)])
    nc = (K + pad) // SOFTMAX_CHUNK
    sc = s.reshape(B, T, -1, nc, SOFTMAX_CHUNK)
    run_max = jnp.maximum(jax.lax.cummax(jnp.max(sc, axis=-1), axis=3), -1e30)  # [B,T,H,nc]
    p = jnp.exp(sc - run_max[..., None])
    final = run_max[..., -1]
    corr = jnp.exp(run_max - final[..., None])
    denom = jnp.sum(jnp.sum(p, axis=-1) * corr, axis=-1) + jnp.exp(sink.astype(F32) - final)
    pr = p.astype(cdtype(cfg)).astype(F32) if cfg.compute_dtype == "bfloat16" else p
    kc = keys.astype(F32).reshape(B, T, nc, SOFTMAX_CHUNK, d)
    num = jnp.einsum("bthcj,btcjd,bthc->bthd", pr, kc, corr, precision=jax.lax.Precision.HIGHEST)
    return (num / denom[..., None]).astype(q.dtype)


# ----------------------------------------------------------------------------- window
def window_positions(qpos, clip, W: int, fresh: bool):
    """Positions each query reads from its sliding window, in the reference's list order.

    qpos [B,T]; clip [B] (replay_start: positions below it are never read). Decode/continuation order:
    W slots for positions t-W+1..t (oldest first). Fresh prefill order (a chunk starting at 0, as the
    reference's start_pos==0 path): min(T, W) slots from max(0, t-W+1). Invalid slots are -1.
    """
    T = qpos.shape[1]
    Wl = min(T, W) if fresh else W
    i = jnp.arange(Wl, dtype=jnp.int32)
    t = qpos[..., None]
    base = jnp.maximum(t - W + 1, 0) if fresh else t - W + 1
    pos = base + i
    ok = (pos >= 0) & (pos <= t) & (pos >= clip[:, None, None])
    return jnp.where(ok, pos, -1)


def window_store_index(pos, pos0, W: int, fresh: bool):
    """Index into the window store: the chunk alone when fresh, else concat(ring[W], chunk)."""
    if fresh:
        return jnp.maximum(pos, 0)
    rel = pos - pos0[:, None, None]
    return jnp.where(rel >= 0, W + rel, jnp.mod(pos, W))


def ring_update(ring, kv, pos0, W: int, n_valid=None):
    """New ring after appending the first n_valid rows of chunk kv [B,T,d] (positions pos0..): slot s holds
    the latest position p with p % W == s. Padding rows (>= n_valid) never enter the ring."""
    T = kv.shape[1]
    n = jnp.full_like(pos0, T) if n_valid is None else n_valid
    last = pos0 + n - 1  # [B]
    s = jnp.arange(W, dtype=jnp.int32)
    p = last[:, None] - jnp.mod(last[:, None] - s, W)  # [B,W]
    rel = p - pos0[:, None]
    from_chunk = jnp.take_along_axis(kv, jnp.clip(rel, 0, T - 1)[..., None], axis=1)
    return jnp.where((rel >= 0)[..., None], from_chunk, ring).astype(ring.dtype)


# ----------------------------------------------------------------------------- compressor
def compress(cfg, p, x, qpos, pos0, n_valid, ratio: int, kv_state, score_state, *, with_rows: bool = False):
    """New compressed latents from the first n_valid rows of a chunk (pre-RoPE, RMS-normed), with the
    partial-group carry.

    Returns latent [B,G,d], entry index j [B,G], valid [B,G] (group complete), and the new carry (`carry_at` the
    chunk's end); with `with_rows` also the chunk's extended rows (kv, score) [B, r-1+T, d] (`carry_at` of any
    shorter end: speculative verification keeps only the accepted rows' carry).
    Ratio 1: one entry per token. Ratio 2: group j = tokens {2j, 2j+1}; softmax over the two tokens per
    channel of the f32 gate scores; an incomplete trailing group waits in (kv_state, score_state) [B,r,d].
    """
    B, T, _ = x.shape
    if ratio == 1:
        lat = rms_norm(cfg, dense(cfg, p["wkv"], x), p["norm"])
        out = (lat, qpos, qpos < (pos0 + n_valid)[:, None], kv_state, score_state)
        return out + ((None, None),) if with_rows else out
    kv = dense(cfg, p["wkv"], x, f32=True)
    sc = dense(cfg, p["wgate"], x, f32=True)
    r = ratio
    # E = [pending r-1 slots for positions pos0-(r-1)..pos0-1, chunk]; position p sits at p - pos0 + r - 1
    prev = pos0[:, None] - (r - 1) + jnp.arange(r - 1)  # [B, r-1]
    slot = jnp.mod(prev, r)
    pk = jnp.take_along_axis(kv_state, slot[..., None], axis=1)
    ps = jnp.take_along_axis(score_state, slot[..., None], axis=1)
    ek = jnp.concatenate([pk, kv], axis=1)
    es = jnp.concatenate([ps, sc], axis=1)
    G = (T + r - 1) // r + 1
    j = pos0[:, None] // r + jnp.arange(G)  # [B,G]
    members = j[..., None] * r + jnp.arange(r) - pos0[:, None, None] + (r - 1)  # [B,G,r] indices into E
    mi = jnp.clip(members, 0, T + r - 2).reshape(B, -1)
    gk = jnp.take_along_axis(ek, mi[..., None], axis=1).reshape(B, G, r, -1)
    gs = jnp.take_along_axis(es, mi[..., None], axis=1).reshape(B, G, r, -1)
    pooled = jnp.sum(gk * jax.nn.softmax(gs, axis=2), axis=2)
    end = pos0 + n_valid
    valid = (j + 1) * r <= end[:, None]
    lat = rms_norm(cfg, pooled.astype(cdtype(cfg)), p["norm"])
    new_kv, new_sc = carry_at(ek, es, pos0, end, r)
    out = (lat, j, valid, new_kv, new_sc)
    return out + ((ek, es),) if with_rows else out


def carry_at(ek, es, pos0, end, r: int):
    """The ratio-r compressor's carry once the positions before `end` [B] are consumed: the open group's members
    at slot p % r, the other slots empty (kv 0, score -inf). From a chunk's extended rows E (ek, es [B, r-1+T, d]:
    position p at row p - pos0 + r - 1, i.e. the r-1 pending positions before the chunk, then the chunk), any end
    in [pos0, pos0 + T]: the one home of the carry rule (compress keeps the chunk's end; speculative verification
    keeps the last accepted row's)."""
    n = ek.shape[1]
    gstart = (end // r) * r
    pp = gstart[:, None] + jnp.arange(r)  # candidate positions of the open group
    live = pp < end[:, None]
    src = jnp.clip(pp - pos0[:, None] + (r - 1), 0, n - 1)
    nk = jnp.take_along_axis(ek, src[..., None], axis=1)
    ns = jnp.take_along_axis(es, src[..., None], axis=1)
    return jnp.where(live[..., None], nk, 0.0), jnp.where(live[..., None], ns, NEG_INF)


def build_entries(cfg, p_comp, p_idx, lat, j, ratio: int, freqs):
    """From pre-RoPE latents: index keys (k_norm(wk lat), RoPE at j*ratio, FP4/UE8M0-32 qdq) and the
    stored latent (RoPE at j*ratio, FP4/E4M3-16 qdq)."""
    k = rms_norm(cfg, dense(cfg, p_idx["wk"], lat), p_idx["k_norm"])
    k = apply_rope(k, j * ratio, freqs)
    lat = apply_rope(lat, j * ratio, freqs)
    if cfg.qdq:
        k = quant.fp4_qdq(k, 32, "ue8m0")
        lat = quant.fp4_qdq(lat, 16, "e4m3")
    return lat, k


# ----------------------------------------------------------------------------- indexer
def index_query(cfg, p, x, qr, qpos, freqs, lin=linear):
    """Index queries q [B,T,Hi,di] (RoPE'd, FP4-qdq'd) and head weights w [B,T,Hi] (scaled, compute dtype).
    The head count comes from the weights (a tensor-parallel rank passes its rows); the weights' scale uses the
    model's cfg.index_n_heads."""
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    dt = cdtype(cfg)
    q = lin(cfg, p["wq_b"], qr).reshape(*qr.shape[:-1], -1, di)
    q = apply_rope(q, qpos, freqs)
    if cfg.qdq:
        q = quant.fp4_qdq(q, 32, "ue8m0")
    w = (dense(cfg, materialize(p["weights_proj"]), x).astype(F32) * jnp.float32(di ** -0.5 * Hi ** -0.5)).astype(dt)
    return q, w


def index_head_terms(q, w, index_k, dt):
    """Per-head indexer terms [B,T,Hi,C] f32: bf16(relu(bf16(q_h . k)) * w_h), the reference's first two rounding
    points. The products are formed in f32 and rounded explicitly: XLA:CPU otherwise fuses a bf16 multiply into
    the f32 reduction and drops that rounding, even without excess precision."""
    rnd = round_to(dt)
    s = rnd(mm(q, index_k.astype(dt), "bthd,bcd->bthc"))
    return rnd(jnp.maximum(s, 0) * w[..., None].astype(F32))


def visible_scores(s, qpos, ratio: int):
    """Scores [B,T,C] with the entries a row cannot reach yet (position >= (t+1)//ratio) set to -inf."""
    C = s.shape[-1]
    vis = jnp.arange(C)[None, None, :] < ((qpos + 1) // ratio)[..., None]
    return jnp.where(vis, s, NEG_INF)


def index_scores(cfg, p, x, qr, qpos, index_k, ratio: int, freqs, lin=linear):
    """Lightning-indexer scores [B,T,C] over every cache entry; unreachable entries are -inf. The reference
    rounds to bf16 after the dot, after relu(s) * w and after the head sum."""
    dt = cdtype(cfg)
    q, w = index_query(cfg, p, x, qr, qpos, freqs, lin)
    return visible_scores(round_to(dt)(jnp.sum(index_head_terms(q, w, index_k, dt), axis=2)), qpos, ratio)


def round_to(dt):
    """f32 -> f32 rounded to `dt`'s precision (round to nearest even), kept as f32; identity for f32."""
    if dt == F32:
        return lambda v: v.astype(F32)
    fi = jnp.finfo(dt)
    return lambda v: jax.lax.reduce_precision(v.astype(F32), exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def candidate_block_ids(scores_full, visible, *, n_keep: int, block_size: int):
    """The layer-20 candidate filter on full-scan scores [B,T,C] -> ascending block ids [B,T,n_keep], -1 padded.

    Block score = max of its `block_size` entries; the block holding the newest visible entry (visible - 1) is
    forced in with +inf; the top n_keep blocks by score are kept (ties: lower block first, as lax.top_k); blocks
    whose score is -inf are dropped."""
    B, T, C = scores_full.shape
    pad = -C % block_size
    sc = jnp.pad(scores_full, [(0, 0), (0, 0), (0, pad)], constant_values=NEG_INF)
    nb = (C + pad) // block_size
    blk = jnp.max(sc.reshape(B, T, nb, block_size), axis=-1)
    last = (visible.astype(jnp.int32) - 1) // block_size
    blk = jnp.where(jnp.arange(nb)[None, None] == last[..., None], jnp.inf, blk)
    kb = min(n_keep, nb)
    vals, idx = jax.lax.top_k(blk, kb)
    ids = jnp.sort(jnp.where(vals > NEG_INF, idx, nb), axis=-1)
    ids = jnp.where(ids == nb, -1, ids).astype(jnp.int32)
    if kb < n_keep:
        ids = jnp.pad(ids, [(0, 0), (0, 0), (0, n_keep - kb)], constant_values=-1)
    return ids


def candidate_blocks(cfg, scores, qpos, ratio: int):
    """`candidate_block_ids` as a block mask [B,T,n_blocks] (the XLA branch's carry)."""
    bs = cfg.candidate_block_size
    B, T, C = scores.shape
    nb = -(-C // bs)
    ids = candidate_block_ids(scores, (qpos + 1) // ratio, n_keep=min(cfg.candidate_topk_blocks, nb), block_size=bs)
    bi = jnp.arange(B)[:, None, None]
    ti = jnp.arange(T)[None, :, None]
    return jnp.zeros((B, T, nb), bool).at[bi, ti, jnp.where(ids >= 0, ids, nb)].set(True, mode="drop")


def select_topk(cfg, scores, qpos, ratio: int):
    """Top `index_topk` entries by score (ties: lower index first), re-sorted by position; unreachable -> -1."""
    C = scores.shape[-1]
    k = min(cfg.index_topk, C)
    _, idx = jax.lax.top_k(scores, k)
    idx = jnp.sort(idx, axis=-1)
    clen = ((qpos + 1) // ratio)[..., None]
    return jnp.where(idx < clen, idx, -1).astype(jnp.int32)


def mask_to_candidates(scores, block_mask, bs: int):
    C = scores.shape[-1]
    m = jnp.repeat(block_mask, bs, axis=-1)[..., :C]
    return jnp.where(m, scores, NEG_INF)


def select_topk_entries(scores, blocks, visible, *, k: int):
    """Top-k entries of block-subset scores [B,T,nb*bs] (as the Pallas indexer returns them for `blocks`
    [B,T or 1,nb]) -> entry ids [B,T,k] ascending, -1 padded (unreachable / -inf picks).

    Ties go to the lower entry index, as lax.top_k on the full masked score row. Equals
    select_topk(mask_to_candidates(full_scores, mask)) with k = min(index_topk, C) whenever a query with fewer
    than k finite candidates has no visible entry outside its candidates; this holds when the candidates come from
    candidate_block_ids and k <= (n_keep - 1) * bs + 1 (every config: 512 <= 16377)."""
    B, T, E = scores.shape
    nb = blocks.shape[-1]
    bs = E // nb
    blocks = jnp.broadcast_to(blocks, (B, T, nb)).astype(jnp.int32)
    kk = min(k, E)
    vals, col = jax.lax.top_k(scores, kk)  # columns are in ascending entry order (blocks ascending)
    blk = jnp.take_along_axis(blocks, col // bs, axis=-1)
    ent = blk * bs + col % bs
    ok = (vals > NEG_INF) & (blk >= 0) & (ent < visible[..., None])
    big = jnp.iinfo(jnp.int32).max
    ent = jnp.sort(jnp.where(ok, ent, big), axis=-1)
    ent = jnp.where(ent == big, -1, ent).astype(jnp.int32)
    if kk < k:
        ent = jnp.pad(ent, [(0, 0), (0, 0), (0, k - kk)], constant_values=-1)
    return ent
