"""The ops seam: the one module through which the model calls every op that has (or will have) a fused kernel
or a sharded variant, and the only module of the model package that may import `pallas_kernels`.

`ExecContext` is the frozen execution context of a compiled program: the global-KV storage strategy
(dense buffers or the paged pool), the kernel implementation ("xla" | "pallas"), the device mesh with its
parallel layout (`dsv41_jax.sharding.Parallel`: TP or DP/DEP; None: one device, no mesh at all) and the
training hooks (`TrainHooks`; None when serving). It is hashable and passed as a static argument, so it is
part of every jit key: two contexts never share a compiled program, and nothing is chosen by environment
variables or at import time.

Operands travel as one typed pytree per op boundary: `AttentionOperands` (the kernel package's
SparseAttentionOperands) and `IndexerInputs`, built by the model, passed whole through this seam and the
shard_map of dsv41_jax.parallel (specs from the fields) to the implementation; the KV state is a typed
`kv_cache.KVState` whose SWA / global parts are read and written by their strategies (no branch on which keys
a state holds). Adding an attention operand touches the model (producer) and the kernel (and the XLA branch
here when the reference reads it), nothing in between.

Every op below takes the context first. Its XLA branch is the reference (the functions of `layers` /
`attention` / `kv_cache`), and it is the default. A Pallas branch exists only where `PALLAS_OPS` has an
implementation; asking for `kernels="pallas"` while any op still lacks one fails when the context is built,
naming those ops: there is no silent fallback.

Sharded branches (the bodies live in `dsv41_jax.parallel`, the only module that calls shard_map): under
tensor parallelism `linear(split="column"|"row")`, `csa_attention`, `grouped_out_proj`, `indexer` and `moe` run
their single-device implementation on each rank's shard inside a shard_map (psum where a contraction is
split); under data parallelism the caller runs the whole step inside `data_parallel` and every op is local
except `moe`, which dispatches tokens to the experts' ranks (DEP). Without a mesh every op is exactly the
single-device op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from dsv41_jax import attention as attn
from dsv41_jax import layers, parallel, quant
from dsv41_jax.kv_cache import DenseKV, KVState, PagedKV, SwaPool, SwaRings
from dsv41_jax.params import lin_weight
from dsv41_jax.rope import apply_rope
from dsv41_jax.sharding import Parallel
from dsv41_jax.train_attention import TRAIN_ATTENTION, blocked_attention, flash_attention, onepass_core
from dsv41_jax.weights import LayerRef, materialize
from pallas_kernels import act_quant_kernel, gemm, mega_gate, mega_mhc, mhc
from pallas_kernels import indexer as index_kernel
from pallas_kernels import moe as moe_gemm
from pallas_kernels import ring_write as ring_kernel
from pallas_kernels import sparse_attention as attn_kernel

KERNEL_CHOICES = ("xla", "pallas")
# Ops whose XLA implementation also runs inside a Pallas program (same operands and KV layout), so that a context
# may keep them on XLA where their kernel loses (ExecContext.xla_ops).
XLA_SWAPPABLE_OPS = ("gate", "hc_boundary", "hc_coefficients", "ring_write", "lm_head", "act_quant")
# What `--kernels auto` keeps on XLA: the fused kernels that measured slower than XLA's fusions on the H200
# (bench/results/fused_kernels_h200.json, in-program loop time per call at D = 5120: Mega-mHC 72.9 us vs 27.8 at
# 1 row, 1159 vs 34.7 at 256; Mega-Gate (384 experts) 43.2 vs 21.5 at 1 row, 94.6 vs 66.3 at 256; ring_write
# 23.8 vs 17.6 at 1 row; Mega-mHC again on an H100 after its tensor-core logits: one launch 31.6, two 24.5, XLA 31.4
# us at 1 row, and medium's decode ITL with the one-launch form 16.68 / 27.03 ms against 16.52 / 25.15 at
# B = 1 / 8 with XLA's: bench/results/mega_mhc_ablation_tc_h100.json, decode_medium_fp8_mega_mhc_tc_ab_h100.json).
# `--kernels pallas` runs every kernel. The Sinkhorn kernel (hc_coefficients) stays on
# inside XLA's boundary: XLA runs its 19 iterations as a while loop of ~4 kernels each, ~6,000 of a medium decode
# step's ~9,900 kernels; with the kernel, 3,858 kernels and FP8 ITL 18.1 ms instead of 30.2 at batch 1
# (bench/results/decode_medium_fp8_sinkhorn_ab_h200.json, profile_decode_medium_fp8_auto*_h200.json).
# "act_quant" (the GEMMs' FP8 inputs in one kernel instead of XLA's three) is counted (~110 launches fewer a step at
# B = 1) but not yet timed: auto keeps XLA's until an ITL run shows it faster (bench.common "auto+act-quant").
AUTO_XLA_OPS = ("gate", "hc_boundary", "ring_write", "act_quant")
F32, BF16 = jnp.float32, jnp.bfloat16

# One CSA2 attention call's operands (model -> ops -> shard_map -> kernel): see
# pallas_kernels/sparse_attention/operands.py.
AttentionOperands = attn_kernel.SparseAttentionOperands


@partial(jax.tree_util.register_dataclass, data_fields=["x", "qr", "qpos", "src", "cand", "freqs"],
         meta_fields=["ratio", "cand_source", "uses_cand"])
@dataclass(frozen=True, kw_only=True)
class IndexerInputs:
    """One index-source layer's indexer operands (model -> ops); the ops branch computes the index queries."""
    x: jax.Array  # [B, T, D] the attention input (after attn_norm)
    qr: jax.Array  # [B, T, q_lora_rank] the normed low-rank query
    qpos: jax.Array  # [B, T] int32 positions of the rows
    src: jax.Array  # [] int32 KV source slot whose index keys are scored
    cand: jax.Array  # the candidate carry: block mask [B, T, nb] (XLA) / block ids [B, T, n_keep] (Pallas)
    freqs: jax.Array  # [rope_dim / 2] f32 the layer's RoPE frequencies
    ratio: int  # compress ratio of the source
    cand_source: bool  # this layer computes the candidate blocks
    uses_cand: bool  # this layer (Reindex) scores only the candidate blocks


@partial(jax.tree_util.register_dataclass, data_fields=["h", "y", "mix"], meta_fields=[])
@dataclass(frozen=True)
class Residual:
    """The mHC residual stream between two sublayers: h [B, T, hc, D] still owes the last sublayer's output
    y [B, T, D], to be mixed in with the post / comb of the packed mixes `mix` [B, T, (2+hc)*hc] f32 (pre | post |
    comb: layers.hc_split), whose pre is also the next sublayer's pre-mix (single-pass mHC). `hc_boundary`
    settles it; owing nothing is y = 0, post = 0, comb = I (hc_post then returns h exactly)."""
    h: jax.Array
    y: jax.Array
    mix: jax.Array

    @staticmethod
    def owing_nothing(cfg, h, pre) -> Residual:
        """h [B, T, hc, D] with the pre-mix pre [B, T, hc] of its next sublayer."""
        hc = cfg.hc_mult
        eye = jnp.broadcast_to(jnp.eye(hc, dtype=F32), (*pre.shape[:-1], hc, hc))
        return Residual(h, jnp.zeros(h.shape[:-2] + h.shape[-1:], h.dtype),
                        layers.hc_pack(pre.astype(F32), jnp.zeros_like(pre, F32), eye))

    def settled(self, cfg) -> Residual:
        """The same stream with y mixed in (the XLA hc_post; at band ends and before Engram)."""
        pre, post, comb = layers.hc_split(cfg, self.mix)
        return Residual.owing_nothing(cfg, layers.hc_post(self.y, self.h, post, comb), pre)

    @property
    def pre(self):
        return self.mix[..., :self.h.shape[-2]]

    def take_rows(self, rows) -> Residual:
        """Rows [B, n] of every field (the decoder band's rows)."""
        return Residual(jnp.take_along_axis(self.h, rows[:, :, None, None], axis=1),
                        jnp.take_along_axis(self.y, rows[:, :, None], axis=1),
                        jnp.take_along_axis(self.mix, rows[:, :, None], axis=1))


# ----------------------------------------------------------------------------- Pallas implementations
def _view(p):
    """(weight stack, scale stack or None, layer index or None) of a linear given as a LayerRef or a dict."""
    if isinstance(p, LayerRef):
        return p.stack["weight"], p.stack.get("scale"), p.index
    return p["weight"], p.get("scale"), None


# FP8 activations of at most this many tokens are quantised inside the GEMM kernels (`quantize_x`); larger inputs
# are quantised once by XLA and passed as codes. 0: never in the kernels. Measured on an H200 (docs/BENCHMARKS.md,
# "FP8 activations quantised in the kernels"): at 1 and 8 tokens the kernels' repeated quantisation of their x tiles
# (once per N tile, 36-512 times) cost more device time than the ~480 XLA kernels it removes saved.
QUANTIZE_X_MAX_TOKENS = 0
# Above that, inputs of at most this many rows are quantised by one Pallas kernel (pallas_kernels/act_quant_kernel.py:
# the codes and the f32 block multipliers the kernels read, one launch) instead of XLA's three (the block amax, the
# codes, the multipliers); larger inputs (prefill chunks) by XLA. The op "act_quant" in ExecContext.xla_ops (as under
# `--kernels auto`, AUTO_XLA_OPS): XLA's at every size.
ACT_QUANT_KERNEL_MAX_ROWS = 256


def _xla_encode(x2):
    """x [M, K] -> (E4M3 codes, E8M0 codes) by XLA (dsv41_jax.quant.fp8_encode)."""
    return quant.fp8_encode(x2, 32)


def _kernel_encode(x2):
    """x [M, K] -> (uint8 E4M3 codes, f32 multipliers): one kernel up to ACT_QUANT_KERNEL_MAX_ROWS rows, else XLA."""
    if x2.shape[0] <= ACT_QUANT_KERNEL_MAX_ROWS:
        return act_quant_kernel.quantize(x2)
    return _xla_encode(x2)


def _pallas_linear_f32(cfg, p, x, xq=None, encode=_xla_encode):
    """FP8 weights with the reference's FP8 activations: up to QUANTIZE_X_MAX_TOKENS rows the kernel puts x onto
    act_qdq's grid as it loads it (`quantize_x`, pallas_kernels/act_quant.py); above, x goes to the kernel as E4M3
    codes + block scales from `encode` (`_kernel_encode` or `_xla_encode`: the same values). xq: x already on
    act_qdq's grid (hc_boundary's output; quantizing it again gives the same values)."""
    dt = layers.cdtype(cfg)
    w, s, layer = _view(p)
    if s is not None and cfg.qdq:
        x2 = (x if xq is None else xq).astype(dt).reshape(-1, x.shape[-1])
        if x2.shape[0] <= QUANTIZE_X_MAX_TOKENS:
            y = gemm.matmul(x2, w, scale=s, layer=layer, quantize_x=True)
        else:
            codes, xs = encode(x2)
            y = gemm.matmul(codes, w, scale=s, layer=layer, x_scale=xs)
    else:
        y = gemm.matmul(layers.act_qdq(cfg, x.astype(dt), p).reshape(-1, x.shape[-1]), w, scale=s, layer=layer)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _pallas_linear(cfg, p, x, xq=None, encode=_xla_encode):
    return _pallas_linear_f32(cfg, p, x, xq, encode).astype(layers.cdtype(cfg))


def _xla_linear_f32(cfg, p, x):
    """`layers.linear` before its final rounding (the partial products of a row-parallel linear)."""
    p = materialize(p)
    dt = layers.cdtype(cfg)
    return layers.mm(layers.act_qdq(cfg, x.astype(dt), p), lin_weight(p, dt), "...i,oi->...o")


def _pallas_routed_experts(cfg, p, x, weights, idx, encode=_xla_encode):
    """The reference's sort / grouped GEMMs / scatter-add, with GEMMs that read only the routed experts."""
    dt = layers.cdtype(cfg)
    N, D = x.shape
    order, tok, sizes, xs, quantized = parallel.rows_by_expert(cfg, p, x, idx)

    def gdot(a, name):
        w, s, layer = _view(p[name])
        return moe_gemm.grouped_matmul(a, w, sizes, scale=s, layer=layer).astype(dt)

    rw = weights.reshape(-1)[order]
    (w1, s1, layer), (w3, s3, _) = _view(p["w1"]), _view(p["w3"])
    if s1 is not None and quantized:  # MXFP4 and FP8 activations (quantised in the kernels: QUANTIZE_X_MAX_TOKENS)
        # no zeroed output buffers (all_rows_routed): rows past sum(sizes) (expert ids out of range, as DEP's
        # padding rows) come back undefined, and the select below drops them (it fuses into the scatter-add)
        w, s, layer2 = _view(p["w2"])
        kw = dict(limit=cfg.swiglu_limit, dtype=dt, all_rows_routed=True)
        if N <= QUANTIZE_X_MAX_TOKENS:
            h = moe_gemm.grouped_swiglu(x.astype(dt)[tok], w1, w3, sizes, rw, scale1=s1, scale3=s3, layer=layer,
                                        quantize_x=True, **kw)
            y = moe_gemm.grouped_matmul(h, w, sizes, scale=s, layer=layer2, quantize_x=True, all_rows_routed=True)
        else:
            xq, xc = encode(x.astype(dt))
            h = moe_gemm.grouped_swiglu(xq[tok], w1, w3, sizes, rw, scale1=s1, scale3=s3, layer=layer,
                                        x_scale=xc[tok], **kw)
            hq, hc = encode(h)
            y = moe_gemm.grouped_matmul(hq, w, sizes, scale=s, layer=layer2, x_scale=hc, all_rows_routed=True)
        routed = jnp.arange(y.shape[0])[:, None] < jnp.sum(sizes)
        return jnp.zeros((N, D), F32).at[tok].add(jnp.where(routed, y.astype(dt).astype(F32), 0.0))
    if s1 is not None:  # MXFP4: w1, w3, the SwiGLU and the routing weight in one kernel
        h = moe_gemm.grouped_swiglu(xs, w1, w3, sizes, rw, scale1=s1, scale3=s3, layer=layer,
                                    limit=cfg.swiglu_limit, dtype=dt)
    else:
        h = (layers.swiglu(cfg, gdot(xs, "w1"), gdot(xs, "w3")) * rw[:, None]).astype(dt)
    if quantized:
        h = quant.fp8_qdq(h, 32)
    return jnp.zeros((N, D), F32).at[tok].add(gdot(h, "w2").astype(F32))


def _pallas_grouped_out_proj(cfg, w, o):
    """WO-A as a grouped GEMM: the G output groups are G 'experts' of M = B*T rows each."""
    B, T, G, din = o.shape
    stack, layer = (w.stack, w.index) if isinstance(w, LayerRef) else (w, None)
    w4 = stack.reshape(*stack.shape[:-2], G, cfg.o_lora_rank, din)  # [(L,) G, oL, din]: a free reshape
    rows = o.transpose(2, 0, 1, 3).reshape(G * B * T, din).astype(BF16)
    y = moe_gemm.grouped_matmul(rows, w4, np.full((G,), B * T, np.int32), layer=layer)  # sizes known: static
    return y.astype(o.dtype).reshape(G, B, T, -1).transpose(1, 2, 0, 3)


def _paged_index_scores(q, w, keys, head_partial: bool = False):
    blocks, visible, view, ratio, bs = keys
    return index_kernel.index_scores_paged(
        index_kernel.IndexerOperands(q=q, w=w, blocks=blocks, visible=visible, ratio=ratio, block_size=bs), view,
        head_partial=head_partial)


def _pallas_indexer(ex: ExecContext, cfg, p, a: IndexerInputs, state: KVState):
    """Score paged FP4 index keys in place: every block at full-scan layers, only the candidate blocks at the
    Reindex layers (cost flat in the context); the selection rules are the reference's. TP: each rank scores its
    index heads (their f32 partial sums psum'd, then rounded once: parallel.tp_paged_index_scores)."""
    kv = ex.kv
    if not kv.paged:
        raise ValueError("the Pallas indexer reads the paged global KV (PagedKV)")
    visible = (a.qpos + 1) // a.ratio
    C = kv.capacity(state.glob, a.ratio)
    bs = cfg.candidate_block_size
    B, T = a.qpos.shape
    nb = -(-C // bs)
    blocks = a.cand if a.uses_cand else jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (B, 1, nb))
    view = index_kernel.PagedIndexKV(pages=state.glob.pages, page_table=state.glob.page_table,
                                     region=kv.region_offset("idx", a.ratio, a.src),
                                     page_tokens=kv.layout.page_tokens, entry_bytes=kv.layout.entry_bytes("idx"))
    if ex.tp:
        keys = (blocks, visible, view)

        def score(q, w, k):
            return _paged_index_scores(q, w, (*k, a.ratio, bs), head_partial=True)

        scores = parallel.tp_paged_index_scores(ex, cfg, p, a, keys, score, _local_linear(ex))
    else:
        q, w = attn.index_query(cfg, p, a.x, a.qr, a.qpos, a.freqs, lin=_local_linear(ex))
        scores = _paged_index_scores(q, w, (blocks, visible, view, a.ratio, bs))
    cand = a.cand
    if a.cand_source:
        cand = attn.candidate_block_ids(scores, visible, n_keep=cfg.candidate_topk_blocks, block_size=bs)
    topk = attn.select_topk_entries(scores, blocks, visible, k=min(cfg.index_topk, C))
    return topk, cand


def _pallas_attention(cfg, kv: PagedKV, a: AttentionOperands, state: KVState):
    """Reads the packed FP8 rings (a SwaPool) and the FP4 latents straight from the page pool."""
    if not isinstance(state.swa, SwaPool) or not kv.paged:
        raise ValueError("the Pallas attention reads the engine's packed SWA rings (SwaPool) and paged global KV")
    region = kv.region_offset("lat", a.ratio, a.src) if a.sel is not None else jnp.int32(0)
    view = attn_kernel.PagedAttentionKV(ring=state.swa.pool, ring_slot=state.swa.slots, pages=state.glob.pages,
                                        page_table=state.glob.page_table, region=region,
                                        page_tokens=kv.layout.page_tokens, entry_bytes=kv.layout.entry_bytes("lat"))
    return attn_kernel.paged_sparse_attention(a, view, scale=a.q.shape[-1] ** -0.5)


def _pallas_hc_boundary(cfg, res: Residual, w, sub: str, quantize: bool):
    """Mega-mHC: the whole boundary in one kernel, the mHC weights read in place from their layer stacks."""
    B, T, hc, D = res.h.shape
    N = B * T
    names = (f"hc_{sub}_fn", f"hc_{sub}_scale", f"hc_{sub}_base", f"{sub}_norm")
    if isinstance(w, LayerRef):
        arrays, layer = [w.stack[n] for n in names], w.index
    else:
        arrays, layer = [w[n] for n in names], None
    h, x, xq, mix = mega_mhc.hc_boundary(
        res.y.reshape(N, D), res.h.reshape(N, hc, D), res.mix.reshape(N, -1), *arrays, layer=layer, hc=hc,
        iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.norm_eps, quantize=quantize)
    return (h.reshape(B, T, hc, D), x.reshape(B, T, D), None if xq is None else xq.reshape(B, T, D),
            mix.reshape(B, T, -1))


def _pallas_lm_head(x, w):
    """The head on the bf16 weight the checkpoint stores: f32 x split into three bf16 terms (gemm.matmul_f32x)."""
    x2 = x.reshape(-1, x.shape[-1])
    return gemm.matmul_f32x(x2, w).reshape(*x.shape[:-1], w.shape[0])


def _pallas_hc_coefficients(cfg, m, scale, base, layer=None):
    """The Sinkhorn of the mixes in one kernel (the XLA boundary's while loop is ~4 launches per iteration);
    with `layer`, scale / base are the layer stacks, read in place."""
    return mhc.hc_coefficients(m, scale, base, hc=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                               layer=layer)


def _pallas_gate(cfg, p, x):
    """Mega-Gate: the router in one kernel, the gate weight read in place from its layer stack."""
    w, b, layer = (p.stack["weight"], p.stack["bias"], p.index) if isinstance(p, LayerRef) else (
        p["weight"], p["bias"], None)
    lead = x.shape[:-1]
    wts, idx = mega_gate.route(x.reshape(-1, x.shape[-1]), w, b, k=cfg.n_activated_experts,
                               route_scale=cfg.route_scale, norm_topk_prob=cfg.norm_topk_prob, layer=layer)
    return wts.reshape(*lead, -1), idx.reshape(*lead, -1)


def _pallas_ring_write(cfg, state: KVState, l, kv, pos0, n_valid) -> KVState:
    """The chunk's entries quantised, packed and stored into the packed ring pool in place, in one kernel."""
    pool = ring_kernel.ring_write(state.swa.pool, kv, state.swa.slots, pos0, n_valid, l)
    return replace(state, swa=replace(state.swa, pool=pool))


# op name -> Pallas implementation (None: not written yet); each kernel lives in pallas_kernels/<op>/.
PALLAS_OPS: dict[str, object] = {
    "linear": _pallas_linear,  # small-M GEMM on bf16 / FP8 block-32 weights, layer read in-kernel
    "routed_experts": _pallas_routed_experts,  # active-experts-only grouped GEMM (bf16 / MXFP4)
    "grouped_out_proj": _pallas_grouped_out_proj,  # WO-A, per output group
    "sparse_attention": _pallas_attention,  # the FP8 rings + top-k FP4 latents read in place, in one kernel
    "indexer": _pallas_indexer,  # lightning indexer over paged FP4 index keys (candidates only at Reindex)
    "gate": _pallas_gate,  # Mega-Gate: gate GEMM, sqrtsoftplus, bias, top-k, normalisation in one kernel
    "ring_write": _pallas_ring_write,  # FP8 quantise + pack + in-place store of the SWA entries
    "hc_boundary": _pallas_hc_boundary,  # Mega-mHC: hc-post, mixes + Sinkhorn, hc-pre, RMSNorm, FP8 in one kernel
    "hc_coefficients": _pallas_hc_coefficients,  # the Sinkhorn alone, inside XLA's boundary (and the draft's mixes)
    "lm_head": _pallas_lm_head,  # f32 logits from the bf16-stored head, read once (gemm.matmul_f32x)
    "act_quant": act_quant_kernel.quantize,  # a GEMM input's FP8 codes + multipliers in one launch (_kernel_encode)
}


def missing_pallas_ops() -> list[str]:
    return [name for name, impl in PALLAS_OPS.items() if impl is None]


def swa_layout(ex: ExecContext):
    """The SWA-ring strategy a compiled engine program uses with this context: the Pallas kernels read and write
    the packed pool in place (SwaPool); the XLA ops read per-sequence rings unpacked once per call (SwaRings)."""
    return SwaPool if ex.pallas else SwaRings


def pallas_config_problems(cfg) -> list[str]:
    """Why the Pallas kernels cannot serve `cfg` (empty: they can). They implement the production formats: bf16
    compute, FP8/FP4 KV (qdq on), windows walked in 64-entry chunks."""
    problems = []
    if cfg.compute_dtype != "bfloat16":
        problems.append(f"compute_dtype {cfg.compute_dtype} (needs bfloat16)")
    if not cfg.qdq:
        problems.append("qdq off (the kernels read FP8 rings and FP4 pages)")
    if cfg.window_size % 64:
        problems.append(f"window {cfg.window_size} (needs a multiple of 64)")
    return problems


def check_kernels(kernels: str):
    """Raise ValueError unless every op can run with `kernels`."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "pallas":
        missing = missing_pallas_ops()
        if missing:
            raise ValueError("--kernels pallas: these ops have no Pallas version yet: " + ", ".join(missing)
                             + " (use --kernels xla)")


def check_kernels_with_parallel(kernels: str, parallel: Parallel | None):
    """The one home of the rules on kernels and parallel layouts (the engine's config calls it too): raise
    ValueError if `kernels` cannot run with `parallel`. Every Pallas kernel runs under TP (head-split attention,
    indexer and WO-A inside their shard_maps, the replicated ops' kernels on every rank) and under DP / DEP (the
    whole step per rank), so there is nothing to refuse today."""
    check_kernels(kernels)
    if parallel is not None and parallel.mode not in ("tp", "dp"):
        raise ValueError(f"unknown parallel mode {parallel.mode!r}")


@dataclass(frozen=True)
class TrainHooks:
    """Training-only behaviour of the model step (static, part of the jit key; None in serving):
    balance: the gate's bias gets the batch's expert-load signal through its gradient slot (layers.balanced_gate);
    indexer_stride > 0: each index-source layer adds the indexer KL / recall terms of every stride-th query row
    to the step's auxiliary output (model.StepAux);
    attention: the form of the attention core in fresh (training) chunks, one of train_attention.TRAIN_ATTENTION
    ("served": the reference's gathered online softmax; the others: dsv41_jax.train_attention);
    head_bf16: the LM head's GEMM takes bf16 operands (f32 accumulation) instead of the served f32 ones. With bf16
    compute and the QAT view both operands hold bf16 values already, so only the accumulation order changes; the
    f32 forward and its two gradient GEMMs took 17 ms of a 2048 x 32 training step on the H200."""
    balance: bool = True
    indexer_stride: int = 0
    attention: str = "served"
    head_bf16: bool = False

    def __post_init__(self):
        if self.attention not in TRAIN_ATTENTION:
            raise ValueError(f"TrainHooks.attention {self.attention!r}: expected one of {TRAIN_ATTENTION}")


@dataclass(frozen=True)
class ExecContext:
    kv: DenseKV | PagedKV = DenseKV()  # global-KV storage: per-sequence buffers or the page pool
    kernels: str = "xla"
    mesh: Mesh | AbstractMesh | None = None  # the mesh of `parallel` (AbstractMesh: lowering only); None: one device
    parallel: Parallel | None = None  # the layout over `mesh` (TP or DP/DEP)
    hooks: TrainHooks | None = None  # training-only hooks (None: the serving / reference step)
    xla_ops: tuple[str, ...] = ()  # with kernels="pallas": these ops (of XLA_SWAPPABLE_OPS) run XLA's version

    def __post_init__(self):
        check_kernels(self.kernels)
        bad = [o for o in self.xla_ops if o not in XLA_SWAPPABLE_OPS]
        if bad:
            raise ValueError(f"ExecContext.xla_ops {bad}: only {XLA_SWAPPABLE_OPS} have an XLA version that runs "
                             "beside the Pallas kernels")
        if (self.mesh is None) != (self.parallel is None):
            raise ValueError("ExecContext: a mesh needs its parallel layout and a layout needs its mesh")
        if self.parallel is not None:
            par = self.parallel
            if tuple(self.mesh.axis_names) != (par.axis,) or self.mesh.shape[par.axis] != par.size:
                raise ValueError(f"ExecContext: mesh {dict(self.mesh.shape)} does not match {par.describe()}")
            check_kernels_with_parallel(self.kernels, par)
            if par.ep and par.a2a == "auto":
                raise ValueError("ExecContext: resolve the all-to-all backend first (Parallel.resolved)")

    @property
    def pallas(self) -> bool:
        return self.kernels == "pallas"

    @property
    def tp(self) -> bool:
        """Tensor parallel: the ops below wrap their own shard_map."""
        return self.parallel is not None and self.parallel.mode == "tp"

    @property
    def ep(self) -> bool:
        """Expert parallel (DEP): the caller runs the step inside `data_parallel`; moe exchanges tokens."""
        return self.parallel is not None and self.parallel.ep


DEFAULT = ExecContext()


def _impl(ex: ExecContext, name: str):
    return PALLAS_OPS[name] if ex.pallas and name not in ex.xla_ops else None


def _encoder(ex: ExecContext):
    """How this context's Pallas GEMMs get their FP8 inputs: the act_quant kernel, or XLA's ops where "act_quant" is
    in ex.xla_ops."""
    return _xla_encode if _impl(ex, "act_quant") is None else _kernel_encode


def _local_linear(ex: ExecContext):
    impl = _impl(ex, "linear")
    return layers.linear if impl is None else partial(impl, encode=_encoder(ex))


# ----------------------------------------------------------------------------- GEMMs
def linear(ex: ExecContext, cfg, p, x, split: str | None = None, xq=None):
    """y = x W^T for a bf16 or FP8 block-32 linear (`layers.linear`), output in the compute dtype.
    split: how tensor parallelism splits it: "column" (output rows; the result stays split on its last dim),
    "row" (input columns, x split on its last dim; psum) or None (replicated). Ignored without TP.
    xq: x already FP8-quantised as the linear quantises its input (`hc_boundary`'s output, or None); the Pallas
    GEMM then skips its own quantisation (the same values: fp8_qdq is idempotent), the XLA reference ignores it."""
    if split is not None and ex.tp:
        f32 = partial(_pallas_linear_f32, encode=_encoder(ex)) if ex.pallas else _xla_linear_f32
        return parallel.tp_linear(ex, cfg, p, x, split, _local_linear(ex), f32)
    if ex.pallas and ex.tp:  # a replicated linear: the kernel on every rank
        enc = _encoder(ex)
        return parallel.replicated(ex, lambda p_, x_, xq_: _pallas_linear(cfg, p_, x_, xq_, enc), p, x, xq)
    if xq is not None and ex.pallas:
        return _pallas_linear(cfg, p, x, xq, _encoder(ex))
    return _local_linear(ex)(cfg, p, x)


def lin(ex: ExecContext):
    """`linear` bound to a context: what the reference building blocks take as their `lin` argument."""
    return partial(linear, ex)


def lm_head(ex: ExecContext, x, w):
    """f32 logits = x @ w^T in f32 (the reference's head). w is the head as the model holds it: f32, or bf16 where
    the loader kept the checkpoint's dtype (`checkpoints.kernel_layout.head_as_stored`: exact, its values are bf16).
    A bf16 head runs the Pallas kernel (half the bytes of the f32 GEMM, the same products) when the context has
    it and the head is not split by tensor parallelism; otherwise XLA's f32 GEMM on f32(w)."""
    impl = _impl(ex, "lm_head")
    if impl is not None and w.dtype == BF16 and not ex.tp:
        return impl(x.astype(F32), w)
    return layers.mm(x.astype(F32), w.astype(F32), "...i,vi->...v")


def routed_experts(ex: ExecContext, cfg, p, x, weights, idx):
    impl = _impl(ex, "routed_experts")
    if impl is None:
        return layers.routed_experts(cfg, p, x, weights, idx)
    return impl(cfg, p, x, weights, idx, encode=_encoder(ex))


def _pallas_moe(ex: ExecContext, cfg, p, x, xq, gate):
    """`layers.moe` with the Pallas GEMMs, fed the FP8-quantised input `xq` of a fused producer when there is one
    (the routed experts and the shared expert's w1 / w3 quantise x themselves otherwise: the same values)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq2 = None if xq is None else xq.reshape(x2.shape)
    w, idx = gate(cfg, _gate_weights(gate, p), x2)
    experts_in = xq2 if xq2 is not None and "scale" in p["experts"]["w1"] else x2
    y = routed_experts(ex, cfg, p["experts"], experts_in, w, idx)
    sh = p["shared"]
    hs = layers.swiglu(cfg, linear(ex, cfg, sh["w1"], x2, xq=xq2), linear(ex, cfg, sh["w3"], x2, xq=xq2))
    y = y + linear(ex, cfg, sh["w2"], hs.astype(x.dtype)).astype(F32)
    return y.astype(x.dtype).reshape(shape)


def _gate(ex: ExecContext):
    """The router: `layers.gate` (XLA), its kernel (Pallas), or `layers.balanced_gate` under the training hooks."""
    if ex.hooks is not None and ex.hooks.balance:
        return layers.balanced_gate
    return _impl(ex, "gate") or layers.gate


def _gate_weights(gate, p):
    """The kernel reads the gate weight in place (a LayerRef); the jnp routers take the layer's arrays."""
    return p["gate"] if gate is _pallas_gate else materialize(p["gate"])


def moe(ex: ExecContext, cfg, p, x, valid=None, xq=None):
    """sqrtsoftplus-routed experts + the shared expert (`layers.moe` with this context's GEMMs).
    valid [B, T] bool marks real rows (DEP never sends the others); xq: x FP8-quantised by its producer
    (`hc_boundary`; used by the Pallas GEMMs only). Returns (y like x, rows dropped by the DEP capacity: int32
    scalar, 0 elsewhere)."""
    none = jnp.zeros((), jnp.int32)
    gate = _gate(ex)
    if not ex.tp and (not ex.ep or ex.parallel.size == 1):
        # (DEP over one rank: one rank owns every expert, nothing to exchange, so the single-device MoE runs as
        # is. On one H200 the ragged exchange with itself cost +16% decode ITL and +315% prefill (medium;
        # bench/results/parallel_medium_h200_exchange.json): XLA's ragged_all_to_all is not free with one peer.)
        local = replace(ex, mesh=None, parallel=None)
        if ex.pallas:
            return _pallas_moe(local, cfg, p, x, xq, gate), none
        return layers.moe(cfg, p, x, lin=lin(local), experts=partial(routed_experts, local), gate=gate), none
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if ex.tp and gate is _pallas_gate:
        w, idx = parallel.replicated(ex, lambda g, x_: gate(cfg, g, x_), p["gate"], x2)
    else:
        w, idx = gate(cfg, _gate_weights(gate, p), x2)
    if ex.tp:
        y, dropped = parallel.tp_moe(ex, cfg, p, x2, w, idx, _local_linear(ex)), none
    else:
        ok = jnp.ones(x2.shape[0], bool) if valid is None else valid.reshape(-1)
        experts_local = partial(routed_experts, replace(ex, mesh=None, parallel=None))
        y, dropped = parallel.ep_moe(ex, cfg, p, x2, w, idx, ok, experts_local, _local_linear(ex))
    return y.astype(x.dtype).reshape(shape), dropped


def _grouped_out_proj_local(ex: ExecContext):
    impl = _impl(ex, "grouped_out_proj")
    if impl is not None:
        return impl

    def xla(cfg, w, o):
        wo_a = materialize(w).astype(o.dtype).reshape(o.shape[2], cfg.o_lora_rank, -1)
        return layers.mm(o, wo_a, "btgd,grd->btgr").astype(o.dtype)

    return xla


def grouped_out_proj(ex: ExecContext, cfg, w, o):
    """WO-A: o [B, T, G, H*d/G] -> [B, T, G, o_lora_rank], one block-diagonal (per output group) projection with
    the bf16 weight w [G*o_lora_rank, H*d/G] (a LayerRef or an array). TP: each rank its output groups."""
    if ex.tp:
        return parallel.tp_grouped_out_proj(ex, _grouped_out_proj_local(ex), cfg, w, o)
    return _grouped_out_proj_local(ex)(cfg, w, o)


def engram(ex: ExecContext, cfg, p, h, ids, rows=None):
    """`rows`: host-gathered table rows instead of `ids` (dsv41_jax.engram_rows)."""
    return layers.engram(cfg, p, h, ids, lin=lin(ex), rows=rows)


# ----------------------------------------------------------------------------- mHC
def hc_boundary(ex: ExecContext, cfg, res: Residual, w, sub: str):
    """A sublayer boundary (`layers.hc_boundary`): settle `res`, the next sublayer's input and the next mixes.
    w: the layer's parameters (a LayerRef into the layer stacks, or a dict) with hc_{sub}_fn / _scale / _base and
    {sub}_norm; sub: "attn" | "ffn". Returns (h' [B,T,hc,D], x [B,T,D], xq: x FP8-quantised for the next
    sublayer's FP8 linears (Pallas with FP8 weights; else None), mix' [B,T,(2+hc)*hc])."""
    impl = _impl(ex, "hc_boundary")
    if impl is not None:
        quantize = cfg.qdq and cfg.weight_format == "fp8"
        if ex.tp:
            return parallel.replicated(ex, lambda r, w_: impl(cfg, r, w_, sub, quantize), res, w)
        return impl(cfg, res, w, sub, quantize)
    p = materialize(w)
    coefficients, kernel = _coefficients(ex, cfg), _impl(ex, "hc_coefficients")
    if isinstance(w, LayerRef) and not ex.tp and kernel is not None:
        # the kernel reads the layer's scale / base rows in place: no slice kernels for them
        stacks = (w.stack[f"hc_{sub}_scale"], w.stack[f"hc_{sub}_base"], w.index)

        def coefficients(m, _scale, _base, stacks=stacks):
            return kernel(cfg, m, stacks[0], stacks[1], layer=stacks[2])
    h, x, mix = layers.hc_boundary(cfg, res.h, res.y, res.mix, p[f"hc_{sub}_fn"], p[f"hc_{sub}_scale"],
                                   p[f"hc_{sub}_base"], p[f"{sub}_norm"], coefficients)
    return h, x, None, mix


def _coefficients(ex: ExecContext, cfg):
    """The Sinkhorn kernel as layers.hc_mixes' `coefficients` (replicated under TP), or None: the jnp reference."""
    impl = _impl(ex, "hc_coefficients")
    if impl is None:
        return None
    if ex.tp:
        return lambda m, s, b: parallel.replicated(ex, partial(impl, cfg), m, s, b)
    return partial(impl, cfg)


def hc_mixes(ex: ExecContext, cfg, x, fn, scale, base):
    """`layers.hc_mixes` with the context's Sinkhorn (the draft's boundaries, which have no packed mixes)."""
    return layers.hc_mixes(cfg, x, fn, scale, base, _coefficients(ex, cfg))


# ----------------------------------------------------------------------------- attention and indexer
def csa_attention(ex: ExecContext, cfg, a: AttentionOperands, state: KVState):
    """One layer's CSA2 attention core, then the inverse RoPE when a.freqs is given: a.q [B,T,H,d] over each row's
    sliding window (the ring before this chunk + the chunk's own a.chunk_kv [B,T,d], in the reference's list
    order, clipped at a.clip) followed by its selected compressed latents (a.sel [B,T,k], -1 = none; None for
    SWA-only layers).
    TP: each rank its heads of the operands (their `heads` fields), over the replicated window / latents."""
    local = partial(_csa_local, replace(ex, mesh=None, parallel=None))
    if ex.tp:
        return parallel.tp_attention(ex, local, cfg, a, state)
    return local(cfg, a, state)


def _inverse_rope(a: AttentionOperands, o):
    """The attention output's inverse RoPE at its query positions (when the operands carry the layer's freqs)."""
    if a.freqs is None:
        return o
    qpos = a.pos0[:, None] + jnp.arange(o.shape[1], dtype=jnp.int32)[None]
    return apply_rope(o, qpos, a.freqs, inverse=True)


def _csa_local(ex: ExecContext, cfg, a: AttentionOperands, state: KVState):
    impl = _impl(ex, "sparse_attention")
    if impl is not None and not a.fresh:
        return impl(cfg, ex.kv, a, state)  # the kernel applies the inverse RoPE in its epilogue
    return _inverse_rope(a, _csa_core(ex, cfg, a, state))


def _csa_core(ex: ExecContext, cfg, a: AttentionOperands, state: KVState):
    if ex.hooks is not None and ex.hooks.attention in ("blocked", "flash") and a.fresh:
        core = blocked_attention if ex.hooks.attention == "blocked" else flash_attention
        return core(cfg, a, None if a.sel is None else ex.kv.all_latents(state.glob, a.ratio, a.src))
    q, kv = a.q, a.chunk_kv
    B, T, H, d = q.shape
    W = cfg.window_size
    qpos = a.pos0[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    wpos = attn.window_positions(qpos, a.clip, W, a.fresh)
    widx = attn.window_store_index(wpos, a.pos0, W, a.fresh)
    store = kv if a.fresh else jnp.concatenate([state.swa.ring(cfg, a.layer), kv], axis=1)
    keys = jnp.take_along_axis(store, widx.reshape(B, -1)[..., None], axis=1).reshape(B, T, -1, d)
    valid = wpos >= 0
    if a.sel is not None:
        ck = ex.kv.latents(state.glob, a.ratio, a.src, a.sel)
        keys = jnp.concatenate([keys, ck.astype(keys.dtype)], axis=2)
        valid = jnp.concatenate([valid, a.sel >= 0], axis=2)
    core = onepass_core if ex.hooks is not None and ex.hooks.attention == "onepass" else attn.sparse_attention
    return core(cfg, q, keys.astype(q.dtype), valid, a.sink, d ** -0.5)


def ring_write(ex: ExecContext, cfg, state: KVState, l, kv, pos0, n_valid) -> KVState:
    """The chunk's SWA entries [B,T,d] (its first n_valid rows) enter layer l's rings (the state's SWA
    strategy: per-sequence rings, or the packed pool in place: one kernel with Pallas)."""
    impl = _impl(ex, "ring_write")
    if impl is not None and isinstance(state.swa, SwaPool) and cfg.qdq:
        if ex.tp:
            return parallel.replicated(ex, lambda *a: impl(cfg, *a), state, l, kv, pos0, n_valid)
        return impl(cfg, state, l, kv, pos0, n_valid)
    return replace(state, swa=state.swa.write(cfg, l, kv, pos0, n_valid))


def empty_candidates(ex: ExecContext, cfg, B: int, T: int, C: int):
    """The candidate-block carry before the candidate source ran: a block mask [B,T,nb] (XLA) or block ids
    [B,T,candidate_topk_blocks] (Pallas, -1 = none)."""
    if cfg.candidate_source_layer < 0:
        return jnp.zeros((B, T, 1), bool)
    if _impl(ex, "indexer") is None:
        return jnp.zeros((B, T, -(-C // cfg.candidate_block_size)), bool)
    return jnp.full((B, T, cfg.candidate_topk_blocks), -1, jnp.int32)


def indexer(ex: ExecContext, cfg, p, a: IndexerInputs, state: KVState):
    """An index-source layer's top-k: (entry ids [B,T,k] ascending, -1 = none; the candidate carry, updated
    at the candidate source). Reindex layers (`a.uses_cand`) score only the candidate blocks."""
    impl = _impl(ex, "indexer")
    if impl is not None:
        return impl(ex, cfg, p, a, state)
    index_k = ex.kv.index_keys(state.glob, a.ratio, a.src)
    if ex.tp:
        scores = parallel.tp_index_scores(ex, cfg, p, a, index_k, layers.linear)
    else:
        scores = attn.index_scores(cfg, p, a.x, a.qr, a.qpos, index_k, a.ratio, a.freqs, lin=lin(ex))
    cand = a.cand
    if a.cand_source:
        cand = attn.candidate_blocks(cfg, scores, a.qpos, a.ratio)
    elif a.uses_cand:
        scores = attn.mask_to_candidates(scores, cand, cfg.candidate_block_size)
    return attn.select_topk(cfg, scores, a.qpos, a.ratio), cand


# ----------------------------------------------------------------------------- data parallelism
def data_parallel(ex: ExecContext, fn, in_specs, out_specs):
    """Run `fn` once per data-parallel rank on its block of every argument (see dsv41_jax.parallel): the
    region inside which a DEP context's `moe` exchanges tokens."""
    if ex.parallel is None or ex.parallel.mode != "dp":
        raise ValueError("data_parallel needs a context with a data-parallel layout")
    return parallel.data_parallel(ex, fn, in_specs, out_specs)


def gather_rows(x):
    """Inside `data_parallel`: every rank's rows of x as one array, identical on every rank."""
    return parallel.gather_rows(x)
