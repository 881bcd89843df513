"""The V4.1 CED forward over explicit state: one general chunk step, and the three execution paths.

`step` processes T new tokens per sequence (positions pos0[b] .. pos0[b]+T-1) through
  1. the encoder band (layers before the decoder start, all T rows), writing SWA rings and global KV;
  2. the decoder start layer's global-KV build (compressor + index keys) for all T rows;
  3. the decoder band (decoder start .. L-1) on the last `n_dec` rows only;
  4. the fp32 LM head on the last `n_logits` rows.
With n_dec = T this is the plain causal LM; with n_dec = n_win it is the CED prefill (the decoder's SWA is
clipped at `dec_clip`); with T = 1 it is a decode step.

State: a `dsv41_jax.kv_cache.KVState` (typed pytree; `init_state` makes the dense one, one row per sequence;
the serving engine keeps the same values paged and packed):
  swa   SwaRings [L,B,W,d] (slot = position % W, values already FP8-qdq'd) or the engine's packed SwaPool
  glob  DenseGlobal: lat[r] [n,B,C,d] global KV latents of the ratio-r sources (RoPE'd, FP4-qdq'd; C = max_len
        / r), idx[r] [n,B,C,di] their index keys (FP4-qdq'd); or the engine's PagedGlobal
  comp  CompressorCarry [n_r2,B,2,d] f32: partial ratio-2 groups of the ratio-2 KV sources (None: no such source)
Global-KV writes are skipped for entries whose group starts below `write_from` (a replayed prefix never
rewrites cached KV). SWA reads are clipped at enc_clip / dec_clip (SWA bounded replay, docs/ARCHITECTURE.md):
the caller decides both clips (the engine's ChunkPlan, or `paths`); the model applies them as given.

Inputs are a `ChunkInputs` pytree (named fields, so callers cannot misalign them); the execution context
(`dsv41_jax.ops.ExecContext`: KV storage strategy, kernel choice, mesh and parallel layout) is static and part
of the jit key, and every op with a kernel or sharded variant is called through `dsv41_jax.ops` (the model
only says how tensor parallelism splits a linear: `split="column"` for wq_b, `"row"` for WO-B). Under a
data-parallel layout the caller runs this step inside `ops.data_parallel`, one rank's rows per call.

Besides logits and state a step returns `StepAux` (scalars): the rows the DEP capacity dropped, and with the
training hooks of the context (`ops.TrainHooks`, static) the indexer KL / recall sums of the index-source layers
(`_indexer_terms`; the trainer in training/objective.py turns them into its loss and metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41_jax import attention, layers, ops, quant
from dsv41_jax.config import KIND_IDX, KIND_REUSE, KIND_SRC, KIND_SWA, ModelConfig
from dsv41_jax.kv_cache import CompressorCarry, DenseGlobal, KVState, SwaRings
from dsv41_jax.params import source_slots
from dsv41_jax.rope import apply_rope, layer_freqs
from dsv41_jax.schedule import Segment, decoder_schedule, encoder_schedule
from dsv41_jax.weights import LayerRef

F32 = jnp.float32


# ----------------------------------------------------------------------------- typed inputs / outputs
@partial(jax.tree_util.register_dataclass,
         data_fields=["tokens", "engram_ids", "pos0", "n_valid", "enc_clip", "dec_clip", "write_from", "engram_rows"],
         meta_fields=[])
@dataclass(frozen=True)
class ChunkInputs:
    """The per-call arrays of one chunk step (B sequences x T rows; rows >= n_valid[b] are padding)."""
    tokens: jax.Array  # [B, T] int32 token ids
    engram_ids: jax.Array | None  # [B, T, n_engram_layers, n_cols] int32 Engram rows (None: no Engram layer)
    pos0: jax.Array  # [B] int32 position of row 0
    n_valid: jax.Array  # [B] int32 valid rows
    enc_clip: jax.Array  # [B] int32 SWA clip of the encoder band (replay_start)
    dec_clip: jax.Array  # [B] int32 SWA clip of the decoder band
    write_from: jax.Array  # [B] int32 global-KV groups starting below this position are not (re)written
    # host Engram tables (dsv41_jax.engram_rows): per Engram layer the rows gathered on the host, uint8
    # [B, T, n_cols, row_bytes], used instead of engram_ids (None: the tables are parameters on the device)
    engram_rows: tuple | None = None

    @staticmethod
    def make(tokens, engram_ids=None, *, pos0=0, n_valid=None, enc_clip=0, dec_clip=0, write_from=0):
        """From arrays or scalars (broadcast to [B])."""
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape

        def vec(v):
            return jnp.broadcast_to(jnp.asarray(v, jnp.int32), (B,))

        ids = None if engram_ids is None else jnp.asarray(engram_ids, jnp.int32)
        return ChunkInputs(tokens, ids, vec(pos0), vec(T if n_valid is None else n_valid), vec(enc_clip),
                           vec(dec_clip), vec(write_from))


@partial(jax.tree_util.register_dataclass, data_fields=["moe_dropped", "indexer_kl", "indexer_layers",
                                                       "recall_mass", "recall_random", "recall_rows"], meta_fields=[])
@dataclass(frozen=True)
class StepAux:
    """Scalar side outputs of a step (zeros unless something produced them)."""
    moe_dropped: jax.Array  # [] int32 routed rows the DEP capacity dropped
    indexer_kl: jax.Array  # [] f32 sum over index-source layers of the mean KL(attention || indexer) (hooks)
    indexer_layers: jax.Array  # [] f32 index-source layers that added a KL term (hooks)
    recall_mass: jax.Array  # [] f32 attention mass the top-k captured, summed over binding rows (hooks)
    recall_random: jax.Array  # [] f32 the same for a random pick (k / visible entries) (hooks)
    recall_rows: jax.Array  # [] f32 binding rows counted (more visible entries than k) (hooks)

    @staticmethod
    def zeros() -> StepAux:
        z = jnp.zeros((), F32)
        return StepAux(jnp.zeros((), jnp.int32), z, z, z, z, z)

    def add(self, **terms) -> StepAux:
        return StepAux(**{k: getattr(self, k) + terms.get(k, 0) for k in self.__dataclass_fields__})


@partial(jax.tree_util.register_dataclass, data_fields=["x", "pos", "valid"], meta_fields=[])
@dataclass(frozen=True)
class DraftFeatures:
    """What the DSpark draft reads from the backbone (dsv41_jax.dspark): for each row the decoder band ran on,
    the residual stream entering every cfg.dspark_target_layer_ids layer (after its Engram), averaged over the
    hc copies, concatenated in target order (the reference's `main_hidden`)."""
    x: jax.Array  # [B, R, n_targets * D] compute dtype
    pos: jax.Array  # [B, R] int32 position of each row
    valid: jax.Array  # [B, R] bool: a real (non-padding) row


class ChunkOutputs(NamedTuple):
    logits: jax.Array | None  # [B, n_logits, V] f32 of the last n_logits valid rows (None: no decoder rows)
    state: KVState  # the updated state
    topk: dict  # index-source layer -> its top-k [B, rows, k] (the rows that layer ran on)
    aux: StepAux  # scalar side outputs (DEP drops, training terms)
    features: DraftFeatures | None = None  # the DSpark draft's inputs (step(features=True) only; see step_impl)


@partial(jax.tree_util.register_dataclass, data_fields=["qpos", "pos0", "clip", "write_from", "n_valid"],
         meta_fields=["fresh"])
@dataclass(frozen=True)
class _Rows:
    """Positions of the rows a band runs on (traced) and the static window order."""
    qpos: jax.Array  # [B, T]
    pos0: jax.Array  # [B]
    clip: jax.Array  # [B]
    write_from: jax.Array  # [B]
    n_valid: jax.Array  # [B]
    fresh: bool  # chunk starts at position 0 with an empty ring: the reference's prefill window order


# ----------------------------------------------------------------------------- state
def buffer_len(cfg: ModelConfig, max_len: int, ratio: int) -> int:
    return max(max_len // ratio, 1)


def init_state(cfg: ModelConfig, batch: int, max_len: int | None = None) -> KVState:
    """Dense per-sequence state (SwaRings + DenseGlobal) for `batch` sequences of up to max_len tokens."""
    max_len = max_len or cfg.max_seq_len
    dt = layers.cdtype(cfg)
    _, counts = source_slots(cfg)
    lat, idx, comp = {}, {}, None
    for key, n in counts.items():
        if not key.startswith("src"):
            continue
        r = int(key[-1])
        C = buffer_len(cfg, max_len, r)
        lat[r] = jnp.zeros((n, batch, C, cfg.head_dim), dt)
        idx[r] = jnp.zeros((n, batch, C, cfg.index_head_dim), dt)
        if r > 1:
            comp = CompressorCarry(jnp.zeros((n, batch, r, cfg.head_dim), F32),
                                   jnp.full((n, batch, r, cfg.head_dim), -jnp.inf, F32))
    return KVState(SwaRings.init(cfg, batch, dt), DenseGlobal(lat, idx), comp)


def _take(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(a, i, v):
    return jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0)


# ----------------------------------------------------------------------------- one layer
def _attention(cfg, ex, seg: Segment, kind, params, lref: LayerRef, lp, l, slot, x, xq, state, shared, rows: _Rows,
               forced, aux: StepAux):
    B, T, _ = x.shape
    H, d = cfg.n_heads, cfg.head_dim
    ratio = seg.ratio
    freqs = jnp.asarray(layer_freqs(cfg, ratio))
    ap, aref = lp["attn"], lref["attn"]
    qr = layers.rms_norm(cfg, ops.linear(ex, cfg, aref["wq_a"], x, xq=xq), ap["q_norm"])
    q = apply_rope(ops.linear(ex, cfg, aref["wq_b"], qr, split="column").reshape(B, T, H, d), rows.qpos, freqs)
    kv = apply_rope(layers.rms_norm(cfg, ops.linear(ex, cfg, aref["wkv"], x, xq=xq), ap["kv_norm"]), rows.qpos, freqs)
    if cfg.qdq:
        kv = quant.fp8_qdq(kv, 32)
    topk, sel, src = None, None, shared["src"]
    if ratio:
        if kind == KIND_SRC:
            shared = dict(shared, src=jnp.asarray(slot, jnp.int32))
            if not seg.prebuilt:
                with jax.named_scope("compress"):
                    state = _build_global(cfg, ex, params, slot, ratio, x, state, rows)
        src = shared["src"]
        if kind in (KIND_SRC, KIND_IDX):
            ip = LayerRef(params[seg.stack]["indexer"], slot)
            if forced is not None:
                topk = forced
            else:
                a = ops.IndexerInputs(x=x, qr=qr, qpos=rows.qpos, src=src, cand=shared["cand"], freqs=freqs,
                                      ratio=ratio, cand_source=seg.cand_source, uses_cand=seg.uses_cand)
                with jax.named_scope("indexer"):
                    topk, cand = ops.indexer(ex, cfg, ip, a, state)
                shared = dict(shared, cand=cand)
            shared = dict(shared, topk=topk)
            if ex.hooks is not None and ex.hooks.indexer_stride:
                with jax.named_scope("indexer_kl"):
                    aux = _indexer_terms(cfg, ex, seg, params, lp, slot, x, state, src, rows.qpos, topk, aux)
        sel = shared["topk"]
    # window (ring before this chunk + the chunk) and selected latents, then the chunk enters the ring
    a = ops.AttentionOperands(q=q, chunk_kv=kv, pos0=rows.pos0, clip=rows.clip, sel=sel, sink=ap["attn_sink"],
                              layer=jnp.asarray(l, jnp.int32), src=src, ratio=max(ratio, 1), fresh=rows.fresh,
                              freqs=freqs)
    with jax.named_scope("core"):
        o = ops.csa_attention(ex, cfg, a, state)
    state = ops.ring_write(ex, cfg, state, l, kv, rows.pos0, rows.n_valid)
    o = ops.grouped_out_proj(ex, cfg, aref["wo_a"], o.reshape(B, T, cfg.o_groups, -1))
    return ops.linear(ex, cfg, aref["wo_b"], o.reshape(B, T, -1), split="row"), state, shared, aux, topk


def _indexer_terms(cfg, ex, seg, params, lp, slot, x, state, src, qpos, topk, aux: StepAux) -> StepAux:
    """Training hook (ops.TrainHooks.indexer_stride): the indexer KL term and its recall for one index-source
    layer, on every stride-th query row. The target p is the layer's own dense attention over the visible
    compressed entries (softmax of q . latent per head, averaged over heads; no gradient); the KL is
    KL(p || softmax(index scores)), and only the indexer's query side (wq_b, weights_proj) gets its gradient: x,
    q, the latents and the index keys are stop-gradient. Recall: the attention mass the top-k captures on rows
    with more visible entries than k, against k / visible entries for a random pick."""
    sg = jax.lax.stop_gradient
    B, T, _ = x.shape
    H, d, r = cfg.n_heads, cfg.head_dim, seg.ratio
    s = max(1, min(ex.hooks.indexer_stride, T))
    x, qpos = sg(x[:, s - 1::s]), qpos[:, s - 1::s]
    Ts = x.shape[1]
    freqs = jnp.asarray(layer_freqs(cfg, r))
    ap = sg(lp["attn"])
    qr = sg(layers.rms_norm(cfg, layers.linear(cfg, ap["wq_a"], x), ap["q_norm"]))
    q = apply_rope(layers.linear(cfg, ap["wq_b"], qr).reshape(B, Ts, H, d), qpos, freqs)
    lat = sg(ex.kv.all_latents(state.glob, r, src))  # [B,C,d]
    keys = sg(ex.kv.index_keys(state.glob, r, src))
    C = lat.shape[1]
    vis = jnp.arange(C)[None, None] < ((qpos + 1) // r)[..., None]  # [B,Ts,C]
    nvis = jnp.sum(vis, axis=-1)
    ok = nvis > 0
    att = jnp.einsum("bthd,bcd->bthc", sg(q).astype(F32), lat.astype(F32),
                     precision=jax.lax.Precision.HIGHEST) * d ** -0.5
    att = jnp.where(vis[:, :, None] & ok[..., None, None], att, -1e30)
    p = sg(jnp.where(vis, jnp.mean(jax.nn.softmax(att, axis=-1), axis=2), 0.0))  # [B,Ts,C]
    ip = _take(params[seg.stack]["indexer"], slot)
    scores = attention.index_scores(cfg, ip, x, qr, qpos, keys, r, freqs)
    logq = jax.nn.log_softmax(jnp.where(vis & ok[..., None], scores, -1e30), axis=-1)
    kl = jnp.sum(jnp.where(vis & (p > 0), p * (jnp.log(jnp.maximum(p, 1e-30)) - logq), 0.0), axis=-1)
    okf = ok.astype(F32)
    aux = aux.add(indexer_kl=jnp.sum(kl * okf) / jnp.maximum(jnp.sum(okf), 1.0), indexer_layers=1.0)
    if topk is None:
        return aux
    sel = topk[:, s - 1::s]  # [B,Ts,k]
    mass = jnp.sum(jnp.where(sel >= 0, jnp.take_along_axis(p, jnp.maximum(sel, 0), axis=-1), 0.0), axis=-1)
    k = sel.shape[-1]
    bind = nvis > k  # rows where the top-k really selects
    return aux.add(recall_mass=jnp.sum(jnp.where(bind, mass, 0.0)),
                   recall_random=jnp.sum(jnp.where(bind, k / jnp.maximum(nvis, 1), 0.0)),
                   recall_rows=jnp.sum(bind).astype(F32))


def _build_global(cfg, ex, params, slot, ratio, x, state: KVState, rows: _Rows) -> KVState:
    """A KV source's compressor + index keys for this chunk, written into its global buffers."""
    sp = _take(params[f"src_r{ratio}"], slot)
    freqs = jnp.asarray(layer_freqs(cfg, ratio))
    if ratio > 1:
        ck = jax.lax.dynamic_index_in_dim(state.comp.kv, slot, keepdims=False)
        cs = jax.lax.dynamic_index_in_dim(state.comp.score, slot, keepdims=False)
    else:
        ck = cs = None
    record = ratio > 1 and state.comp.rows_kv is not None  # speculative verification: keep the chunk's rows
    lat, j, ok, ck, cs, *er = attention.compress(cfg, sp["compressor"], x, rows.qpos, rows.pos0, rows.n_valid,
                                                 ratio, ck, cs, with_rows=record)
    lat, k = attention.build_entries(cfg, sp["compressor"], sp["indexer"], lat, j, ratio, freqs)
    ok = ok & (j * ratio >= rows.write_from[:, None])
    state = replace(state, glob=ex.kv.write(state.glob, ratio, slot, lat, k, j, ok))
    if ratio > 1:
        c = state.comp
        rk, rs = (_put(c.rows_kv, slot, er[0][0]), _put(c.rows_score, slot, er[0][1])) if record else (None, None)
        state = replace(state, comp=CompressorCarry(_put(c.kv, slot, ck), _put(c.score, slot, cs), rk, rs))
    return state


def _block(cfg, ex, seg, kind, params, l, slot, carry, rows, forced):
    """One transformer block with single-pass mHC. The residual stream arrives owing the previous block's FFN
    output (ops.Residual); each sublayer boundary (ops.hc_boundary) settles it, computes the next mixes and the
    sublayer's input with the pre-mix computed one boundary earlier."""
    res, state, shared, aux = carry
    lref = LayerRef(params["layers"], l)
    lp = lref.get()  # slices the GEMMs read through `lref` instead are removed by XLA
    with jax.named_scope("hc_attn"):  # scopes name the profile's kernels (bench/profile_train_step.py)
        h, x, xq, a_mix = ops.hc_boundary(ex, cfg, res, lref, "attn")
    with jax.named_scope("attention"):
        o, state, shared, aux, topk = _attention(cfg, ex, seg, kind, params, lref, lp, l, slot, x, xq, state,
                                                 shared, rows, forced, aux)
    with jax.named_scope("hc_ffn"):
        h, x, xq, f_mix = ops.hc_boundary(ex, cfg, ops.Residual(h, o, a_mix), lref, "ffn")
    valid = (rows.qpos - rows.pos0[:, None]) < rows.n_valid[:, None]  # padding rows: never dispatched (DEP)
    with jax.named_scope("moe"):
        y, dropped = ops.moe(ex, cfg, lref["ffn"], x, valid, xq=xq)
    res = ops.Residual(h, y, f_mix)
    return (res, state, shared, aux if ex.parallel is None else aux.add(moe_dropped=dropped)), topk


def _tap(cfg, feats, res, l):
    """Features hook (step(features=True)): the residual entering layer l (res settled), mean over its hc copies,
    into l's slot of feats [B, T, n_targets, D] (not a target layer: nothing written)."""
    if feats is None:
        return None
    slot = jnp.asarray([cfg.dspark_target_layer_ids.index(i) if i in cfg.dspark_target_layer_ids else -1
                        for i in range(cfg.n_layers)], jnp.int32)[l]
    m = jnp.mean(res.settled(cfg).h.astype(F32), axis=-2).astype(feats.dtype)
    return feats.at[:, :, jnp.where(slot < 0, feats.shape[2], slot)].set(m, mode="drop")


def _run_segment(cfg, ex, seg: Segment, params, carry, rows, engram, forced: dict | None, feats=None):
    res, state, shared, aux = carry
    if seg.engram_slot >= 0:
        ids, gathered = engram
        e = seg.engram_slot
        with jax.named_scope("engram"):
            res = res.settled(cfg)
            if gathered is not None:  # host tables: rows gathered outside the program
                h = ops.engram(ex, cfg, params["engram"][e], res.h, None, rows=gathered[e])
            else:
                h = ops.engram(ex, cfg, params["engram"][e], res.h, ids[:, :, e])
        carry = (replace(res, h=h), state, shared, aux)
    n = len(seg.firsts)
    xs = {"first": jnp.asarray(seg.firsts, jnp.int32), "slot": jnp.asarray(seg.slots, jnp.int32)}
    if seg.n_reuse:
        xs["reuse"] = jnp.asarray(seg.reuse, jnp.int32)
    use_forced = forced is not None and seg.is_index_source
    if use_forced:
        xs["forced"] = jnp.stack([forced[l] for l in seg.firsts])
    # the scan carries the features only through a segment holding a target layer
    taps = feats is not None and bool(set(cfg.dspark_target_layer_ids) & {*seg.firsts, *sum(seg.reuse, ())})

    def group(cf, x):
        c, f = cf
        f = _tap(cfg, f, c[0], x["first"])
        c, topk = _block(cfg, ex, seg, seg.kind, params, x["first"], x["slot"], c, rows,
                         x["forced"] if use_forced else None)
        if seg.n_reuse:
            def reuse(cf2, l):
                c2, f2 = cf2
                f2 = _tap(cfg, f2, c2[0], l)
                c2, _ = _block(cfg, ex, seg, KIND_REUSE, params, l, 0, c2, rows, None)
                return (c2, f2), None
            (c, f), _ = jax.lax.scan(reuse, (c, f), x["reuse"])
        return (c, f), topk

    (carry, tapped), topks = jax.lax.scan(group, (carry, feats if taps else None), xs, length=n)
    feats = tapped if taps else feats
    rec = {}
    if seg.is_index_source:
        rec = {l: topks[i] for i, l in enumerate(seg.firsts)}
    return carry, rec, feats


def _shared_init(cfg, ex, state, B, T, ratio):
    if not ratio:
        return {"topk": jnp.zeros((B, T, 1), jnp.int32), "cand": jnp.zeros((B, T, 1), bool),
                "src": jnp.zeros((), jnp.int32)}
    C = ex.kv.capacity(state.glob, ratio)
    k = min(cfg.index_topk, C)
    return {"topk": jnp.full((B, T, k), -1, jnp.int32), "cand": ops.empty_candidates(ex, cfg, B, T, C),
            "src": jnp.zeros((), jnp.int32)}


def _run_band(cfg, ex, segs, params, res: ops.Residual, state, aux, rows, engram, forced, feats=None):
    if len({s.ratio for s in segs if s.ratio}) > 1:
        raise ValueError("every compressed segment of a band must share one compress ratio")
    B, T = res.h.shape[:2]
    rec = {}
    shared = None
    ratio = None
    for seg in segs:
        if seg.ratio != ratio or shared is None:
            ratio = seg.ratio
            shared = _shared_init(cfg, ex, state, B, T, ratio)
        (res, state, shared, aux), r, feats = _run_segment(cfg, ex, seg, params, (res, state, shared, aux), rows,
                                                            engram, forced, feats)
        rec.update(r)
    return res, state, aux, rec, feats


def step_impl(cfg: ModelConfig, params, state: KVState, inp: ChunkInputs, *, fresh: bool, n_dec: int, n_logits: int,
              ex: ops.ExecContext = ops.DEFAULT, forced_topk: dict | None = None,
              features: bool = False) -> ChunkOutputs:
    """One chunk step; see the module docstring.

    The decoder runs on the n_dec rows ending at the last valid row (clamped at row 0) with its SWA clipped at
    inp.dec_clip, exactly as given (n_dec = 0: a non-final CED chunk, encoder band and the decoder's global-KV
    build only). Logits are those of the last n_logits valid rows (every decoder row, in order, when n_logits
    equals the decoder rows). With `features` (static) and a config with dspark_target_layer_ids, the output's
    `features` are the DSpark draft's inputs (DraftFeatures) on the rows the decoder ran on (every row when the
    model has no decoder band; None for a non-final CED chunk); without it nothing extra is computed."""
    B, T = inp.tokens.shape
    dt = layers.cdtype(cfg)
    qpos = inp.pos0[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    h = jnp.take(params["embed"]["weight"], inp.tokens, axis=0).astype(dt)
    h = jnp.repeat(h[:, :, None, :], cfg.hc_mult, axis=2)
    pre = jnp.zeros((B, T, cfg.hc_mult), F32).at[..., 0].set(1.0)
    res = ops.Residual.owing_nothing(cfg, h, pre)
    rows = _Rows(qpos, inp.pos0, inp.enc_clip, inp.write_from, inp.n_valid, fresh)
    enc, dec = encoder_schedule(cfg), decoder_schedule(cfg)
    feats = None
    if features and cfg.dspark_target_layer_ids:
        feats = jnp.zeros((B, T, len(cfg.dspark_target_layer_ids), cfg.dim), dt)
    res, state, aux, rec, feats = _run_band(cfg, ex, enc, params, res, state, StepAux.zeros(), rows,
                                            (inp.engram_ids, inp.engram_rows), forced_topk, feats)
    if not dec:
        start = jnp.zeros((B,), jnp.int32)
    else:
        l = cfg.decoder_start
        lp = _take(params["layers"], l)
        res = res.settled(cfg)
        x = layers.rms_norm(cfg, layers.hc_pre(res.h, res.pre), lp["attn_norm"])
        state = _build_global(cfg, ex, params, source_slots(cfg)[0][l][1], cfg.compress_ratios[l], x, state, rows)
        if n_dec == 0:  # a non-final CED chunk: the encoder band and the decoder's global-KV build only
            return ChunkOutputs(None, state, rec, aux)
        start = jnp.maximum(inp.n_valid - n_dec, 0)
        sel_rows = start[:, None] + jnp.arange(n_dec)[None]
        res = res.take_rows(sel_rows)
        if feats is not None:
            feats = jnp.take_along_axis(feats, sel_rows[:, :, None, None], axis=1)
        drows = _Rows(qpos[:, :n_dec] + start[:, None], inp.pos0 + start, inp.dec_clip, inp.write_from,
                      inp.n_valid - start, fresh and n_dec == T)
        dforced = None
        if forced_topk is not None:
            dforced = {k: jnp.take_along_axis(v, jnp.clip(sel_rows, 0, v.shape[1] - 1)[..., None], axis=1)
                       for k, v in forced_topk.items()}
        res, state, aux, rec_d, feats = _run_band(cfg, ex, dec, params, res, state, aux, drows, None, dforced,
                                                  feats)
        rec.update(rec_d)
    last = inp.n_valid - start - 1  # last valid row within h
    if n_logits == res.h.shape[1]:  # every (decoder) row, in order
        lrows = jnp.broadcast_to(jnp.arange(n_logits)[None], (B, n_logits))
    else:
        lrows = jnp.maximum(last[:, None] - (n_logits - 1) + jnp.arange(n_logits)[None], 0)
    fin = res.take_rows(lrows).settled(cfg)
    with jax.named_scope("head"):
        x = layers.rms_norm(cfg, layers.hc_pre(fin.h, fin.pre), params["norm"]["weight"])
        if ex.hooks is not None and ex.hooks.head_bf16:
            logits = layers.mm(x.astype(jnp.bfloat16), params["head"]["weight"].astype(jnp.bfloat16),
                               "...i,vi->...v")
        else:
            logits = ops.lm_head(ex, x, params["head"]["weight"])
    if feats is not None:
        R = feats.shape[1]
        i = jnp.arange(R, dtype=jnp.int32)[None]
        feats = DraftFeatures(feats.reshape(B, R, -1), inp.pos0[:, None] + start[:, None] + i,
                              i < (inp.n_valid - start)[:, None])
    return ChunkOutputs(logits, state, rec, aux, feats)


step = partial(jax.jit, static_argnames=("cfg", "fresh", "n_dec", "n_logits", "ex", "features"))(step_impl)


KIND_NAMES = {KIND_SWA: "SWA-only", KIND_SRC: "Full", KIND_IDX: "Reindex", KIND_REUSE: "Reuse"}
