"""On-device verification of speculative drafts: greedy acceptance and the standard (lossless) rejection sampler.

A verify program's row i (i = 0..k) holds the token at position pos0 + i (row 0: the request's last sampled
token, rows 1..k: the drafts d_1..d_k); its logits give the target distribution p_i of position pos0 + i + 1, the
position of draft d_{i+1}. Per request, with n_draft drafts (n_draft <= k; the rest of the row is padding):

- temperature <= 0 (greedy): d_{i+1} is accepted iff it equals argmax p_i, while all before it were accepted;
  the token after the a accepted drafts is argmax p_a. Each emitted token is what plain greedy decoding emits.
- temperature > 0 ("standard", Leviathan et al. / vLLM's default): p_i is the filtered target distribution
  (temperature, top-k, top-p, min-p, the grammar mask: exactly what the plain sampler draws from), q_i the draft
  distribution (one-hot at d_{i+1} for greedy drafts, else the draft's probabilities). d_{i+1} is accepted iff
  u_i * q_i(d) < p_i(d), u_i ~ U[0, 1); at the first rejection the token is drawn from the residual
  max(p_i - q_i, 0) (renormalised); when all n_draft are accepted, a bonus token is drawn from p_{n_draft}.
  Every emitted token then follows the target distribution exactly (tests/test_spec_decode.py, chi-square).

Randomness: row i uses the request's stream at counter + i (the same key the plain sampler would use for that
token): the bonus draw is the plain sampler's Gumbel-max draw, so a row without drafts samples exactly as a
decode program does; the acceptance uniforms and the residual draw fold in their own tags.
Outputs per row: the emitted tokens (rows 0..a hold the a accepted drafts then the last token; later rows are
-1), the accepted count a, and every row's logprobs of the raw distribution (as the plain sampler reports).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.engine.sampler import allowed_mask, filtered_logits
from serving.engine.types import MAX_LOGPROBS

ACCEPT_TAG, RESIDUAL_TAG = 1, 2


def residual_probs(p, q):
    """The distribution a rejected position is drawn from: max(p - q, 0), renormalised (p where it is all zero:
    then p == q and no rejection can happen). p, q [..., V]."""
    r = jnp.maximum(p - q, 0.0)
    s = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(s > 0, r / jnp.where(s > 0, s, 1.0), p)


def verify(logits, drafts, n_draft, temperature, top_k, top_p, min_p, seed, counter, allowed=None, draft_probs=None,
           n_logprobs: int = MAX_LOGPROBS):
    """logits [B, T, V] f32 (T = k + 1), drafts [B, k] int32, n_draft [B] (<= k), per-request sampling arrays [B],
    allowed [B, ceil(V/32)] uint32 or None, draft_probs [B, k, V] or None (one-hot drafts) ->
    (tokens [B, T] int32, n_accepted [B] int32, token_logprob [B, T], top_ids [B, T, n], top_logprobs [B, T, n])."""
    B, T, V = logits.shape
    k = T - 1
    raw_lp = jax.nn.log_softmax(logits, axis=-1)
    masked = logits if allowed is None else jnp.where(allowed_mask(allowed, V)[:, None, :], logits, -jnp.inf)
    greedy = temperature <= 0
    g_tok = jnp.argmax(masked, axis=-1).astype(jnp.int32)  # [B, T]

    def rep(v):
        return jnp.repeat(v, T, axis=0)

    z = filtered_logits(masked.reshape(B * T, V), rep(temperature), rep(top_k), rep(top_p), rep(min_p))
    z = z.reshape(B, T, V)
    p = jax.nn.softmax(z, axis=-1)
    ctr = counter[:, None] + jnp.arange(T, dtype=counter.dtype)[None]  # [B, T]

    def row_draws(s, c):
        key = jax.random.fold_in(jax.random.key(s), c)
        return (jax.random.gumbel(key, (V,), jnp.float32),
                jax.random.uniform(jax.random.fold_in(key, ACCEPT_TAG), (), jnp.float32),
                jax.random.gumbel(jax.random.fold_in(key, RESIDUAL_TAG), (V,), jnp.float32))

    g, u, g_res = jax.vmap(jax.vmap(row_draws, in_axes=(None, 0)))(seed, ctr)  # [B,T,V], [B,T], [B,T,V]

    # the draft distribution on rows 0..k-1 (row k has no draft: q = 0, its residual is p itself)
    q = jax.nn.one_hot(drafts, V, dtype=p.dtype) if draft_probs is None else draft_probs.astype(p.dtype)
    q = jnp.concatenate([q, jnp.zeros((B, 1, V), p.dtype)], axis=1)  # [B, T, V]
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, k]
    q_d = jnp.take_along_axis(q[:, :k], drafts[..., None], axis=-1)[..., 0]
    ok = jnp.where(greedy[:, None], drafts == g_tok[:, :k], u[:, :k] * q_d < p_d)
    ok = ok & (jnp.arange(k)[None] < n_draft[:, None])
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # [B]

    # the token after the accepted drafts (row a): greedy argmax, or the residual draw at a rejection, or the bonus
    bonus = jnp.argmax(z + g, axis=-1)
    res = jnp.argmax(jnp.log(residual_probs(p, q)) + g_res, axis=-1)
    rejected = n_acc < n_draft
    a = n_acc[:, None]
    pick_rand = jnp.take_along_axis(jnp.where(rejected[:, None], res, bonus), a, axis=1)[:, 0]
    last = jnp.where(greedy, jnp.take_along_axis(g_tok, a, axis=1)[:, 0], pick_rand).astype(jnp.int32)
    rows = jnp.arange(T)[None]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(rows < a, padded, jnp.where(rows == a, last[:, None], -1)).astype(jnp.int32)
    tok_lp = jnp.take_along_axis(raw_lp, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(raw_lp, n_logprobs)
    return tokens, n_acc, tok_lp, top_ids.astype(jnp.int32), top_lp
