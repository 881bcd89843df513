"""Measured DSpark acceptance: real greedy speculative decoding with the backbone and the draft (no estimate).

`SpecEval.run(prompts, n_new)` decodes every prompt greedily with k drafts per step, exactly as an engine with
greedy verification would: each iteration runs the backbone once over [committed tokens + the k drafts]
(causal: the logits at position j depend on tokens <= j only), accepts the longest prefix of drafts equal to the
backbone's argmax, appends the backbone's next token (the bonus), rebuilds the draft rings from that same
forward's features for the committed positions, and drafts k more from the bonus token. Rejected drafts never
reach the rings (their rows are invalid). The backbone runs over a fixed [B, T] buffer (one compiled program;
positions past the committed length hold drafts or padding, which causality keeps out of the committed rows).

Acceptance per position i (1-based) = steps whose first i drafts were all accepted / steps; mean accepted length
= 1 + mean accepted drafts per step (the bonus counts), i.e. tokens per backbone forward. Rows stop counting once
they have n_new tokens. `greedy(prompts, n_new)` is plain one-token-per-forward greedy decoding with the same
program: the speculative output must equal it token for token (reported as `mismatched_tokens`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax import dspark, model
from training import corpus


def backbone_forward(cfg, params, tokens, engram_ids):
    """The full causal forward over fresh sequences [B, T]: (logits [B,T,V] f32, DraftFeatures of every row)."""
    B, T = tokens.shape
    out = model.step_impl(cfg, params, model.init_state(cfg, B, T), model.ChunkInputs.make(tokens, engram_ids),
                          fresh=True, n_dec=T, n_logits=T, features=True)
    return out.logits, out.features


class SpecEval:
    def __init__(self, cfg, hasher, batch: int, length: int, forward=None):
        """forward: a jitted backbone_forward(params, tokens, ids) of shape [batch, length] to share (or None)."""
        self.cfg, self.hasher, self.B, self.T = cfg, hasher, batch, length
        self.k = cfg.dspark_block_size
        self.forward = forward or jax.jit(lambda p, t, i: backbone_forward(cfg, p, t, i))

        def draft(params, feats_x, feats_pos, anchor, at):
            rings = dspark.write_context(cfg, params, dspark.DraftRings.init(cfg, batch), feats_x, feats_pos,
                                         feats_pos < at[:, None])
            prop = dspark.propose(cfg, params, rings, anchor, at, jax.random.key(0), jnp.zeros((batch,)),
                                  return_probs=False)
            return prop.tokens

        self.draft = jax.jit(draft)
        self.argmax = jax.jit(lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32))

    def _ids(self, buf):
        return None if self.hasher is None else jnp.asarray(self.hasher.hash_ids(buf))

    def _check(self, prompts, n_new):
        B, P = prompts.shape
        if B != self.B or P + n_new + 2 * self.k + 2 > self.T:
            raise ValueError(f"prompts {prompts.shape} + {n_new} new tokens do not fit the [{self.B}, {self.T}] buffer")

    def greedy(self, params, prompts: np.ndarray, n_new: int) -> np.ndarray:
        self._check(prompts, n_new)
        B, P = prompts.shape
        buf = np.full((B, self.T), corpus.PAD, np.int32)
        buf[:, :P] = prompts
        for j in range(n_new):
            logits, _ = self.forward(params, jnp.asarray(buf), self._ids(buf))
            buf[:, P + j] = np.asarray(self.argmax(logits[:, P + j - 1]))
        return buf[:, P:P + n_new]

    def run(self, params, prompts: np.ndarray, n_new: int) -> dict:
        self._check(prompts, n_new)
        B, P = prompts.shape
        k = self.k
        buf = np.full((B, self.T), corpus.PAD, np.int32)
        buf[:, :P] = prompts
        length = np.full(B, P)
        drafts = None
        acc = np.zeros(k, np.int64)
        steps, accepted = 0, 0
        while (length - P < n_new).any():
            tokens = buf.copy()
            if drafts is not None:
                for b in range(B):
                    tokens[b, length[b]:length[b] + k] = drafts[b]
            logits, feats = self.forward(params, jnp.asarray(tokens), self._ids(tokens))
            greedy = np.asarray(self.argmax(logits))  # [B, T]: the backbone's next token after each position
            for b in range(B):
                if length[b] - P >= n_new:
                    continue  # done: this row no longer grows or counts
                a = 0
                if drafts is not None:
                    while a < k and drafts[b, a] == greedy[b, length[b] - 1 + a]:
                        a += 1
                    steps += 1
                    accepted += a
                    acc[:a] += 1
                new = [*(drafts[b, :a] if a else []), greedy[b, length[b] - 1 + a]]
                buf[b, length[b]:length[b] + a + 1] = new
                length[b] += a + 1
            at = length - 1  # the bonus token's position: its context is every committed position before it
            drafts = np.asarray(self.draft(params, feats.x, feats.pos, jnp.asarray(buf[np.arange(B), at]),
                                           jnp.asarray(at, jnp.int32)))
        per_pos = (acc / max(steps, 1)).tolist()
        return {"steps": steps, "accepted_drafts": accepted, "per_position": per_pos,
                "mean_accepted_drafts": accepted / max(steps, 1), "mean_accepted_length": 1 + accepted / max(steps, 1),
                "tokens": buf[:, P:P + n_new]}
