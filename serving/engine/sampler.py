"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, top-n logprobs.

All per-row parameters are arrays, so one compiled program serves any mix of requests. The key of row b
is fold_in(key(seed_b), counter_b): a request with a seed gets the same tokens on any batch composition.
Reported logprobs are those of the raw (unscaled, unfiltered) distribution, as vLLM's default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.engine.types import MAX_LOGPROBS


def filtered_logits(logits, temperature, top_k, top_p, min_p):
    """The temperature-scaled logits with every token outside top-k, top-p and min-p set to -inf (rows with
    temperature <= 0 are scaled by 1). Ties with a cut-off value are kept."""
    V = logits.shape[-1]
    greedy = temperature <= 0
    z = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    srt = jnp.sort(z, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    z = jnp.where(z < kth, -jnp.inf, z)
    p_sorted = jax.nn.softmax(jnp.where(srt < kth, -jnp.inf, srt), axis=-1)
    cum = jnp.cumsum(p_sorted, axis=-1)
    # smallest prefix whose mass reaches top_p; keep ties with the cutoff value
    cut_idx = jnp.sum(cum - p_sorted < top_p[:, None], axis=-1) - 1
    cut = jnp.take_along_axis(srt, jnp.maximum(cut_idx, 0)[:, None], axis=-1)
    z = jnp.where(z < cut, -jnp.inf, z)
    probs = jax.nn.softmax(z, axis=-1)
    return jnp.where(probs < min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, z)


def allowed_mask(allowed, vocab: int):
    """[B, ceil(V/32)] uint32 bitmask -> [B, V] bool (bit t % 32 of word t // 32 = token t)."""
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)[None, None, :]) & 1
    return bits.reshape(allowed.shape[0], -1)[:, :vocab].astype(bool)


def sample(logits, temperature, top_k, top_p, min_p, seed, counter, n_logprobs: int = MAX_LOGPROBS,
           allowed=None):
    """logits [B, V] f32 -> (tokens [B] int32, logprob of token [B], top ids [B, n], top logprobs [B, n]).

    `allowed` (a [B, ceil(V/32)] uint32 token bitmask, e.g. from a grammar) restricts both greedy and sampled
    choices; the reported logprobs stay those of the raw distribution."""
    V = logits.shape[-1]
    lp = jax.nn.log_softmax(logits, axis=-1)
    greedy = temperature <= 0
    if allowed is not None:
        logits = jnp.where(allowed_mask(allowed, V), logits, -jnp.inf)
    z = filtered_logits(logits, temperature, top_k, top_p, min_p)

    def gumbel(s, c):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(s), c), (V,), jnp.float32)

    g = jax.vmap(gumbel)(seed, counter)
    tok = jnp.where(greedy, jnp.argmax(logits, axis=-1), jnp.argmax(z + g, axis=-1)).astype(jnp.int32)
    tok_lp = jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, n_logprobs)
    return tok, tok_lp, top_ids.astype(jnp.int32), top_lp
