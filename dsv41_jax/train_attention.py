"""Training-only forms of the CSA2 attention core, selected by `ops.TrainHooks.attention` (static, part of the
jit key; serving, evaluation and export always run the served form, `dsv41_jax.attention.sparse_attention`).

The served core reproduces the reference kernel's numerics: an online softmax over 64-entry chunks of each
query's gathered key list with a cumulative running max, the unnormalised probabilities rounded to bf16, f32
`Precision.HIGHEST` einsums. Differentiated, it keeps several copies of every query's gathered keys for the
backward. The forms here compute the same quantity (same scores, one softmax over the same keys with the sink,
P rounded to bf16 in a bf16 config) and differ from the served core only by rounding: the max that P is taken
against is the row's overall max instead of a running one.

- "onepass" (`onepass_core`): the served gathered operands, in one pass (bf16 operands, f32 accumulation).
"""

from __future__ import annotations

import jax.numpy as jnp

F32, BF16 = jnp.float32, jnp.bfloat16
TRAIN_ATTENTION = ("served", "onepass")


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
