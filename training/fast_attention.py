"""A training-only form of the CSA2 sparse attention core (`dsv41_jax.attention.sparse_attention`).

The served function reproduces the reference kernel's numerics: an online softmax over 64-entry chunks with a
cumulative running max, the unnormalised probabilities rounded to bf16, f32 `Precision.HIGHEST` einsums over the
gathered keys. Differentiated, that keeps several f32 copies of every query's gathered keys for the backward.
This version computes the same quantity in one pass: the scores q.k (bf16 operands, f32 accumulation), one max
per (row, head) taken together with the sink, the probabilities rounded to bf16, P.V with f32 accumulation.
It differs from the served function only by rounding (the max used for the bf16 rounding of P), so training
with it (`training.objective.training_hooks(fast_attention=True)`) optimises the served model up to bf16 noise;
evaluation and export always run the served function.
"""

from __future__ import annotations

import jax.numpy as jnp

F32, BF16 = jnp.float32, jnp.bfloat16


def sparse_attention(cfg, q, keys, valid, sink, scale):
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
