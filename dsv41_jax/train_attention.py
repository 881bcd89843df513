"""Training-only forms of the CSA2 attention core, selected by `ops.TrainHooks.attention` (static, part of the
jit key; serving, evaluation and export always run the served form, `dsv41_jax.attention.sparse_attention`).

The served core reproduces the reference kernel's numerics: an online softmax over 64-entry chunks of each
query's gathered key list with a cumulative running max, the unnormalised probabilities rounded to bf16, f32
`Precision.HIGHEST` einsums. Differentiated, it keeps several copies of every query's gathered keys for the
backward. The forms here compute the same quantity (same scores, one softmax over the same keys with the sink,
P rounded to bf16 in a bf16 config) and differ from the served core only by rounding: the max that P is taken
against is the row's overall max instead of a running one.

- "onepass" (`onepass_core`): the served gathered operands, in one pass (bf16 operands, f32 accumulation).
- "blocked" (`blocked_attention`, fresh chunks only): nothing is gathered per query. The chunk's rows go in
  blocks of n = window_size query rows (the chunk padded to a multiple of n); block i scores its rows against
  the 2n SWA entries of blocks i-1 and i (a band, masked to the window t-W < j <= t, j >= clip, as
  attention.window_positions) and against every compressed latent of the source [C], masked to each row's
  selected entries (the top-k ids scattered into a boolean [n, C] row mask; ids are distinct, -1 = none), and
  both score sets share one softmax with the sink. The blocks run in a lax.map whose body is rematerialised
  (jax.checkpoint), several blocks per map step (at most BLOCK_SCORES score elements a step), so the backward
  keeps only each block's inputs and memory is O(T x (n + C)) per step, never O(T x C) for the chunk at once.
  Cost: dense scores against all C latents, i.e. C / index_topk times the served compressed-part FLOPs, as
  tensor-core GEMMs instead of per-query gathers.
- "flash" (`flash_attention`, fresh chunks only): the quantity "blocked" computes, by fused Pallas kernels
  (pallas_kernels.train_attention: an online-softmax forward and a flash-style backward behind a custom_vjp) that
  never write a score to HBM; latent blocks that no row of a query block selected are skipped. Same rounding
  points as "blocked" except that P is rounded against the running max (bf16 rounding apart, identical).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.layers import cdtype, mm
from pallas_kernels.train_attention import flash_train_attention

F32, BF16 = jnp.float32, jnp.bfloat16
TRAIN_ATTENTION = ("served", "onepass", "blocked", "flash")
BLOCK_SCORES = 1 << 26  # score elements ([B, rows, H, keys]) of one lax.map step of blocked_attention


def onepass_core(cfg, q, keys, valid, sink, scale):
    """q [B,T,H,d], keys [B,T,K,d] (gathered per query, K = V), valid [B,T,K], sink [H] -> [B,T,H,d]."""
    keys = jnp.where(valid[..., None], keys, 0).astype(BF16)
    s = jnp.einsum("bthd,btkd->bthk", q.astype(BF16), keys, preferred_element_type=F32) * scale
    s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
    sk = sink.astype(F32)
    m = jnp.maximum(jnp.max(s, axis=-1), sk)  # [B,T,H], finite: the sink is always there
    p = jnp.exp(s - m[..., None]).astype(BF16)
    den = jnp.sum(p.astype(F32), axis=-1) + jnp.exp(sk - m)
    num = jnp.einsum("bthk,btkd->bthd", p, keys, preferred_element_type=F32)
    return (num / den[..., None]).astype(q.dtype)


def blocked_attention(cfg, a, lat):
    """One fresh chunk's CSA2 attention core without per-query gathers (module docstring).

    a: the layer's ops.AttentionOperands (a.fresh; q [B,T,H,d], chunk_kv [B,T,d], sel [B,T,k] or None, clip, sink);
    lat: the source's latents [B,C,d] (all of them; None for an SWA-only layer) -> [B,T,H,d] like the served core.
    """
    q = a.q
    dt = q.dtype
    B, T, H, d = q.shape
    W = cfg.window_size
    n = min(W, T)
    nb = -(-T // n)
    pad = nb * n - T
    kv = jnp.pad(a.chunk_kv.astype(dt), [(0, 0), (0, pad), (0, 0)]).reshape(B, nb, n, d)
    band = jnp.concatenate([jnp.pad(kv[:, :-1], [(0, 0), (1, 0), (0, 0), (0, 0)]), kv], axis=2)  # [B,nb,2n,d]
    xs = {"q": jnp.pad(q, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(B, nb, n, H, d), "band": band,
          "i": jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (B, nb))}
    C = 0
    if a.sel is not None:
        C = lat.shape[1]
        lat = lat.astype(dt)
        xs["sel"] = jnp.pad(a.sel, [(0, 0), (0, pad), (0, 0)], constant_values=-1).reshape(B, nb, n, -1)
    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs)  # blocks first
    scale = d ** -0.5
    sink = a.sink.astype(F32)
    rnd = cfg.compute_dtype == "bfloat16"

    def block(x):
        t = x["i"][:, None] * n + jnp.arange(n, dtype=jnp.int32)  # [B,n] row positions (relative to pos0)
        j = x["i"][:, None] * n - n + jnp.arange(2 * n, dtype=jnp.int32)  # [B,2n] band entry positions
        ok = ((j[:, None] <= t[..., None]) & (j[:, None] > t[..., None] - W) & (j[:, None] >= 0)
              & (a.pos0[:, None, None] + j[:, None] >= a.clip[:, None, None]))  # [B,n,2n]
        s = jnp.where(ok[:, :, None], mm(x["q"], x["band"], "bthd,bkd->bthk"), -jnp.inf) * scale
        m = jnp.maximum(jnp.max(s, axis=-1), sink)  # [B,n,H], finite: the sink is always there
        if C:
            sel = x["sel"]
            rows = (jnp.arange(B)[:, None, None], jnp.arange(n)[None, :, None], jnp.where(sel >= 0, sel, C))
            pick = jnp.zeros((B, n, C + 1), bool).at[rows].set(True)[..., :C]  # [B,n,C]
            sc = jnp.where(pick[:, :, None], mm(x["q"], lat, "bthd,bcd->bthc"), -jnp.inf) * scale
            m = jnp.maximum(m, jnp.max(sc, axis=-1))
        p = jnp.exp(s - m[..., None])  # the denominator sums the f32 P, P.V reads it rounded (as served)
        den = jnp.sum(p, axis=-1) + jnp.exp(sink - m)
        num = mm(p.astype(cdtype(cfg)) if rnd else p, x["band"], "bthk,bkd->bthd")
        if C:
            pc = jnp.exp(sc - m[..., None])
            den = den + jnp.sum(pc, axis=-1)
            num = num + mm(pc.astype(cdtype(cfg)) if rnd else pc, lat, "bthc,bcd->bthd")
        return (num / den[..., None]).astype(dt)

    per_block = B * n * H * (2 * n + C)
    out = jax.lax.map(jax.checkpoint(block), xs, batch_size=max(1, min(nb, BLOCK_SCORES // per_block)))
    return jnp.moveaxis(out, 0, 1).reshape(B, nb * n, H, d)[:, :T]


def flash_attention(cfg, a, lat):
    """`blocked_attention`'s quantity by the fused Pallas kernels (pallas_kernels.train_attention; compiled on
    GPU, interpret mode on CPU). Same arguments and result as blocked_attention."""
    dt = a.q.dtype
    C = 0 if a.sel is None else lat.shape[1]
    return flash_train_attention(a.q, a.chunk_kv.astype(dt), lat.astype(dt) if C else None, a.sel, a.sink,
                                 a.pos0, a.clip, window=cfg.window_size, scale=a.q.shape[-1] ** -0.5,
                                 round_p=cfg.compute_dtype == "bfloat16")
