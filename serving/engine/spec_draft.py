"""The DSpark draft inside the engine's programs (--speculative-config '{"method": "dspark", ...}').

The draft (`dsv41_jax.dspark`) reads features of the backbone's decoder rows and keeps one context ring per
stage and request. In the engine every program with decoder rows also runs the draft's side:

- context: the features of the rows whose input tokens are final are written into the request's rings (a
  prefill chunk's decoder rows; a decode's row; a verification's accepted rows 0..a only, so a rejected draft
  never enters a ring: nothing to roll back);
- proposal: every sampling program then drafts k tokens after the token it just produced (the anchor, at the
  position after the last final row): the drafts go to the host in the step's packed outputs (`drafts`) and are
  verified by the next step; with `draft_sample_method` probabilistic their probabilities stay on the device
  (pool `draft_probs`) for the next verification's ratio test.

Pools (one row per ring slot, as the SWA rings; axis 0 or 1 holds the data-parallel ranks' blocks):
  draft_kv    [n_stages, S+1, W, head_dim] compute dtype   every stage's context K/V (slot = position % W)
  draft_pos   [S+1, W] int32                              the position each slot holds (-1: empty)
  draft_probs [S+1, k, V] f32                             probabilistic drafts only: q of the pending drafts
`dspark.propose` reads only slots holding positions pos - W .. pos - 1, so a slot's previous occupant is never
read once the request's own rows cover its window (a CED final chunk's decoder rows do); draft rings are not
part of exact-mode snapshots (a restored request's draft sees only the rows recomputed since: fewer accepted
drafts, never a different output).

Randomness: the draft of the token at counter c folds DRAFT_TAG into the request's key at c, a stream apart from
the target's draws (spec_verify.py) at the same counter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DRAFT_TAG = 3
POOL_AXIS = {"draft_kv": 1, "draft_pos": 0, "draft_probs": 0}


def check_model(cfg, k: int):
    """ValueError unless the model carries a DSpark draft that can draft k tokens."""
    if not getattr(cfg, "has_draft", False):
        raise ValueError("--speculative-config method dspark: this model has no DSpark draft (the checkpoint's "
                         "mtp.* tensors; ModelConfig.has_draft)")
    if k > cfg.dspark_block_size:
        raise ValueError(f"--speculative-config: num_speculative_tokens {k} exceeds the draft's block size "
                         f"{cfg.dspark_block_size}")


class DeviceDraft:
    """DSpark's pools and its part of each program (the runner calls it; cfg, k static)."""

    def __init__(self, cfg, k: int, probabilistic: bool, ex):
        check_model(cfg, k)
        self.cfg, self.k, self.probabilistic, self.ex = cfg, k, probabilistic, ex

    def pool_shapes(self, rows: int) -> dict:
        """name -> (shape, dtype, fill) for `rows` pool rows (all ranks' blocks)."""
        from dsv41_jax.layers import cdtype

        cfg, W = self.cfg, self.cfg.window_size
        out = {"draft_kv": ((cfg.n_mtp_layers, rows, W, cfg.head_dim), cdtype(cfg), 0),
               "draft_pos": ((rows, W), jnp.int32, -1)}
        if self.probabilistic:
            out["draft_probs"] = ((rows, self.k, cfg.vocab_size), jnp.float32, 0)
        return out

    def probs(self, pools, slots):
        """q [B, k, V] of the drafts the rows `slots` are verifying (None: one-hot drafts)."""
        return pools["draft_probs"][slots] if self.probabilistic else None

    def step(self, params, pools, out, slots, feats, valid, anchor=None, anchor_pos=None, sampling=None, ctr=None):
        """Write the context of feature rows `valid` [B, R]; with an anchor [B] (at anchor_pos [B], the token of
        counter ctr [B]) draft k tokens after it. Returns (out, drafts [B, k] int32 or None)."""
        from dsv41_jax import dspark

        rings = dspark.DraftRings(pools["draft_kv"][:, slots], pools["draft_pos"][slots])
        rings = dspark.write_context(self.cfg, params, rings, feats.x, feats.pos, valid, ex=self.ex)
        out = dict(out, draft_kv=out["draft_kv"].at[:, slots].set(rings.kv),
                   draft_pos=out["draft_pos"].at[slots].set(rings.pos))
        if anchor is None:
            return out, None
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), c), DRAFT_TAG))(
            sampling.seed, ctr)
        prop = dspark.propose(self.cfg, params, rings, anchor, anchor_pos, keys, sampling.temperature, k=self.k,
                              ex=self.ex, return_probs=self.probabilistic)
        if self.probabilistic:
            out["draft_probs"] = out["draft_probs"].at[slots].set(prop.probs.astype(jnp.float32))
        return out, prop.tokens.astype(jnp.int32)
