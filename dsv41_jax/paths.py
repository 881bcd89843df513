"""The three execution paths over the same parameters, for scripts and tests (host-side wrappers of `step`):

(a) `forward`      full-sequence causal LM over all layers and tokens (also the training path);
(b) `ced_prefill`  encoder on all tokens, decoder on the last n_win rows with the SWA window clipped at
                   replay_start = N - n_win ("bounded"), on the exact tail W + (L_dec-1)(W-1) ("exact"),
                   or on every row ("full"); `prefill_chunk` continues from an existing state, e.g. a
                   prefix-cache hit replayed from H-128 with `enc_clip` and `write_from`;
(c) `decode_step`  one token per sequence over the explicit state (b) leaves.

Engram hash ids depend on token ids only; they are computed here on the host (EngramHasher) and passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.kv_cache import KVState
from dsv41_jax.model import ChunkInputs, init_state, step


@dataclass
class DecodeState:
    """Per-sequence state between calls: device arrays plus host-side positions and Engram history."""
    arrays: KVState  # the model's dense state (dsv41_jax.kv_cache)
    pos: np.ndarray  # [B] next position
    enc_clip: np.ndarray  # [B] SWA clip of the encoder band (replay_start of the last prefill)
    dec_clip: np.ndarray  # [B] SWA clip of the decoder band
    history: np.ndarray | None  # [B, n-1] compressed ids of the last tokens (Engram), -1 = none

    @property
    def batch(self) -> int:
        return int(self.pos.shape[0])


def _hasher(cfg, hasher):
    if not cfg.engram_layer_ids:
        return None
    return hasher or EngramHasher(cfg)


def _ids(cfg, hasher, tokens, history):
    h = _hasher(cfg, hasher)
    if h is None:
        return None, None
    return jnp.asarray(h.hash_ids(tokens, history)), h.next_history(history, tokens)


def empty_state(cfg: ModelConfig, batch: int, max_len: int | None = None) -> DecodeState:
    z = np.zeros(batch, np.int32)
    hist = None if not cfg.engram_layer_ids else np.full((batch, cfg.engram_max_ngram_size - 1), -1, np.int64)
    return DecodeState(init_state(cfg, batch, max_len), z, z.copy(), z.copy(), hist)


def engram_ids(cfg: ModelConfig, tokens, history=None, hasher=None):
    """Engram table rows [B, T, n_engram_layers, n_cols] int32 for concrete token ids [B, T], computed on the
    host (int64 hashing, as the reference); None when the model has no Engram layer. `history` holds the
    compressed ids of the tokens before the chunk (see EngramHasher.hash_ids)."""
    h = _hasher(cfg, hasher)
    if h is None:
        return None
    return jnp.asarray(h.hash_ids(np.asarray(tokens, np.int32), history))


_host_engram_ids = engram_ids  # `forward` has a parameter of that name


def _concrete(tokens):
    try:
        return np.asarray(tokens, np.int32)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def forward(cfg: ModelConfig, params, tokens, *, engram_ids=None, forced_topk=None, return_topk=False,
            hasher=None):
    """(a) logits [B,T,V] f32 at every position (and the index-source top-k per layer if asked).

    Traceable (jax.jit / nnx.jit) when the Engram rows are given: `engram_ids=paths.engram_ids(cfg, tokens)`
    computed outside the trace (they depend on token ids only); with concrete tokens they are computed here."""
    host = _concrete(tokens)
    if engram_ids is None and cfg.engram_layer_ids:
        if host is None:
            raise TypeError("forward() under a trace needs engram_ids: compute them outside with "
                            "dsv41_jax.paths.engram_ids(cfg, tokens) and pass engram_ids=...")
        engram_ids = _host_engram_ids(cfg, host, hasher=hasher)
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    state = init_state(cfg, B, max_len=T)
    out = step(cfg, params, state, ChunkInputs.make(tokens, engram_ids), forced_topk=forced_topk, fresh=True,
               n_dec=T, n_logits=T)
    logits, rec = out.logits, out.topk
    return (logits, rec) if return_topk else logits


def decoder_rows(cfg: ModelConfig, mode: str, T: int, n_win: int | None = None) -> int:
    if mode == "bounded":
        n = n_win or cfg.window_size
    elif mode == "exact":
        n = cfg.exact_tail_rows()
    elif mode == "full":
        n = T
    else:
        raise ValueError(f"unknown CED mode {mode!r}: bounded | exact | full")
    return max(1, min(n, T))


def prefill_chunk(cfg: ModelConfig, params, ds: DecodeState, tokens, *, mode="bounded", n_win=None,
                  enc_clip=None, write_from=None, n_logits=1, forced_topk=None, hasher=None, fresh=None):
    """Run a chunk of new tokens (positions ds.pos ..) with the CED rule; returns (logits, state, topk).

    enc_clip: SWA clip for the encoder band (default: keep ds.enc_clip). write_from: global-KV entries of
    groups starting below this position are not rewritten (default 0: write all)."""
    tokens = np.asarray(tokens, np.int32)
    B, T = tokens.shape
    n_dec = decoder_rows(cfg, mode, T, n_win)
    fresh = bool(np.all(ds.pos == 0)) if fresh is None else fresh
    ids, hist = _ids(cfg, hasher, tokens, ds.history)
    ec = ds.enc_clip if enc_clip is None else np.broadcast_to(np.asarray(enc_clip, np.int32), (B,))
    dec_clip = ds.pos + (T - n_dec) if n_dec < T else ec
    wf = 0 if write_from is None else write_from
    inp = ChunkInputs.make(tokens, ids, pos0=ds.pos, enc_clip=ec, dec_clip=dec_clip, write_from=wf)
    logits, arrays, rec = step(cfg, params, ds.arrays, inp, forced_topk=forced_topk, fresh=fresh, n_dec=n_dec,
                               n_logits=n_logits)[:3]
    ds = DecodeState(arrays, ds.pos + T, np.asarray(ec, np.int32), np.asarray(dec_clip, np.int32), hist)
    return logits, ds, rec


def ced_prefill(cfg: ModelConfig, params, tokens, *, mode="bounded", n_win=None, max_len=None, n_logits=1,
                forced_topk=None, hasher=None, fresh=None):
    """(b) CED prefill of a fresh prompt; returns (logits of the last n_logits rows, DecodeState, topk)."""
    tokens = np.asarray(tokens, np.int32)
    ds = empty_state(cfg, tokens.shape[0], max_len)
    return prefill_chunk(cfg, params, ds, tokens, mode=mode, n_win=n_win, enc_clip=0, n_logits=n_logits,
                         forced_topk=forced_topk, hasher=hasher, fresh=fresh)


def decode_step(cfg: ModelConfig, params, ds: DecodeState, token, *, forced_topk=None, return_topk=False,
                hasher=None):
    """(c) one token per sequence: returns (logits [B,V], new state[, topk])."""
    tok = np.asarray(token, np.int32).reshape(-1, 1)
    ids, hist = _ids(cfg, hasher, tok, ds.history)
    inp = ChunkInputs.make(tok, ids, pos0=ds.pos, enc_clip=ds.enc_clip, dec_clip=ds.dec_clip)
    logits, arrays, rec = step(cfg, params, ds.arrays, inp, forced_topk=forced_topk, fresh=False, n_dec=1,
                               n_logits=1)[:3]
    ds = replace(ds, arrays=arrays, pos=ds.pos + 1, history=hist)
    return (logits[:, 0], ds, rec) if return_topk else (logits[:, 0], ds)


def rewind(ds: DecodeState, pos) -> DecodeState:
    """Continue from an earlier position with the cached global KV kept (SWA bounded replay: the caller then
    runs tokens [pos, N) with enc_clip=pos and write_from = the cached length). pos must be even when the
    model has ratio-2 sources (groups start fresh); the Engram history is left as is, so pass it the
    history of the tokens before `pos` when the caller knows them."""
    pos = np.broadcast_to(np.asarray(pos, np.int32), ds.pos.shape).copy()
    if np.any(pos % 2):
        raise ValueError("rewind position must be even (ratio-2 compressor groups start fresh)")
    return replace(ds, pos=pos, enc_clip=pos.copy(), dec_clip=pos.copy())
