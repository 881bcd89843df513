"""The parameter tree: its layout, shapes and dtypes, and seeded random initialisation.

Layout (a nested dict of arrays; every per-layer tensor is stacked so layers run under lax.scan):

  embed.weight [V,D] bf16 · norm.weight [D] · head.weight [V,D] f32
  layers.*            stacked over all L layers: mHC (hc_{attn,ffn}_{fn,base,scale}), attn_norm, ffn_norm,
                      attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink},
                      ffn.{gate.{weight,bias}, experts.{w1,w2,w3}, shared.{w1,w2,w3}}
  src_r{1,2}.*        stacked over the KV sources of that ratio: compressor.{wkv, wgate (ratio 2), norm},
                      indexer.{wq_b, weights_proj, wk, k_norm}
  idx.*               stacked over index sources that do not own keys ("Reindex"): indexer.{wq_b, weights_proj}
  engram[i].*         one entry per Engram layer: embed.{weight, scale}, wkv, q_weight, k_weight
  mtp.*               the DSpark draft (only when cfg.has_draft; dsv41_jax.dspark): layers.* stacked over its
                      n_mtp_layers stages (a block as above, dspark_n_routed_experts experts, no compressor /
                      indexer / Engram), main_proj [D, n_targets*D], main_norm, norm, markov_head.{embed, head}
                      [V, rank] (head f32), confidence_head.proj [1, D + rank] f32

A linear is ``{'weight': [out, in]}`` (bf16 weight_format) or ``{'weight': e4m3 [out, in],
'scale': e8m0 [out/32, in/32]}`` (fp8). Routed experts in fp8 format are MXFP4: ``weight`` uint8
[E, out, in/2] (two E2M1 per byte) and ``scale`` e8m0 [E, out, in/32]. Names follow the official
checkpoint so the importer is a renaming.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.config import KIND_IDX, KIND_SRC, ModelConfig

BF16, F32 = jnp.bfloat16, jnp.float32


@dataclass(frozen=True)
class Tensor:
    """A logical tensor: `fmt` says how it is stored ('dense', 'lin' = FP8 block linear when
    weight_format is fp8, 'exp' = MXFP4 experts, 'table' = FP8 per-row-32 Engram table)."""
    shape: tuple[int, ...]  # logical shape, stack dims first
    fmt: str = "dense"
    dtype: object = BF16  # dense dtype / bf16-format dtype
    init: str = "normal"  # normal (std), ones (1 + std*noise), uniform (lo..hi)
    std: float = 1.0
    lo: float = 0.0
    hi: float = 1.0
    axes: tuple = ()  # logical axis name per dim (dsv41_jax.sharding); () = unsharded everywhere


@dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    dtype: object
    role: str  # weight / scale / engram_table
    logical_size: int
    axes: tuple = ()  # logical axis names (a packed or block-scale leaf keeps its tensor's axes)


def _lin(stack, out, inp, axes, **kw):
    return Tensor((*stack, out, inp), "lin", std=inp ** -0.5, axes=axes, **kw)


def source_slots(cfg: ModelConfig):
    """layer -> slot in its stack: ('src_r1'|'src_r2', i) for KV sources, ('idx', i) for Reindex layers."""
    slots, counts = {}, {}
    for l in range(cfg.n_layers):
        kind = cfg.layer_kind(l)
        if kind == KIND_SRC:
            key = f"src_r{cfg.compress_ratios[l]}"
        elif kind == KIND_IDX:
            key = "idx"
        else:
            continue
        slots[l] = (key, counts.get(key, 0))
        counts[key] = counts.get(key, 0) + 1
    return slots, counts


def _block_tensors(cfg: ModelConfig, s: tuple, ls: tuple, E: int) -> dict[tuple, Tensor]:
    """One transformer block's tensors (mHC, norms, attention without compressor / indexer, MoE with E routed
    experts), stacked over `s`, paths relative to the stack."""
    D, H, d = cfg.dim, cfg.n_heads, cfg.head_dim
    qL, G, oL, I = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.moe_inter_dim
    M, hcD = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * D
    t: dict[tuple, Tensor] = {
        ("attn_norm",): Tensor((*s, D), init="ones", std=0.1, axes=(*ls, "embed")),
        ("ffn_norm",): Tensor((*s, D), init="ones", std=0.1, axes=(*ls, "embed")),
        ("attn", "wq_a"): _lin(s, qL, D, (*ls, "q_lora", "embed")),
        ("attn", "q_norm"): Tensor((*s, qL), init="ones", std=0.1, axes=(*ls, "q_lora")),
        ("attn", "wq_b"): _lin(s, H * d, qL, (*ls, "q_heads", "q_lora")),
        ("attn", "wkv"): _lin(s, d, D, (*ls, "kv_latent", "embed")),
        ("attn", "kv_norm"): Tensor((*s, d), init="ones", std=0.1, axes=(*ls, "kv_latent")),
        ("attn", "wo_a"): Tensor((*s, G * oL, H * d // G), std=(H * d // G) ** -0.5,
                                 axes=(*ls, "o_groups", "o_group_in")),
        ("attn", "wo_b"): _lin(s, D, G * oL, (*ls, "embed", "o_groups")),
        ("attn", "attn_sink"): Tensor((*s, H), dtype=F32, axes=(*ls, "heads")),
        ("ffn", "gate", "weight"): Tensor((*s, E, D), std=D ** -0.5, axes=(*ls, "router", "embed")),
        ("ffn", "gate", "bias"): Tensor((*s, E), dtype=F32, std=0.1, axes=(*ls, "router")),
        ("ffn", "experts", "w1"): Tensor((*s, E, I, D), "exp", std=D ** -0.5,
                                         axes=(*ls, "experts", "expert_inter", "embed")),
        ("ffn", "experts", "w2"): Tensor((*s, E, D, I), "exp", std=I ** -0.5,
                                         axes=(*ls, "experts", "embed", "expert_inter")),
        ("ffn", "experts", "w3"): Tensor((*s, E, I, D), "exp", std=D ** -0.5,
                                         axes=(*ls, "experts", "expert_inter", "embed")),
        ("ffn", "shared", "w1"): _lin(s, I, D, (*ls, "expert_inter", "embed")),
        ("ffn", "shared", "w2"): _lin(s, D, I, (*ls, "embed", "expert_inter")),
        ("ffn", "shared", "w3"): _lin(s, I, D, (*ls, "expert_inter", "embed")),
    }
    for sub in ("attn", "ffn"):
        t[(f"hc_{sub}_fn",)] = Tensor((*s, M, hcD), dtype=F32, std=hcD ** -0.5, axes=(*ls, "hc_mix", "hc_embed"))
        t[(f"hc_{sub}_base",)] = Tensor((*s, M), dtype=F32, std=0.5, axes=(*ls, "hc_mix"))
        t[(f"hc_{sub}_scale",)] = Tensor((*s, 3), dtype=F32, init="uniform", lo=0.5, hi=1.0, axes=(*ls, None))
    return t


def draft_tensor_specs(cfg: ModelConfig) -> dict[tuple, Tensor]:
    """The DSpark draft's tensors under ("mtp", ...) (empty without a draft; see dsv41_jax.dspark). The draft is
    small and replicated: every axis of its tensors is None (no sharding rule applies)."""
    if not cfg.has_draft:
        return {}
    D, V, r, S = cfg.dim, cfg.vocab_size, cfg.dspark_markov_rank, cfg.n_mtp_layers
    nt = len(cfg.dspark_target_layer_ids)
    t = {("mtp", "layers", *k): v for k, v in _block_tensors(cfg, (S,), ("mtp_layers",), cfg.draft_experts[0]).items()}
    t.update({
        ("mtp", "main_proj"): _lin((), D, nt * D, ()),
        ("mtp", "main_norm", "weight"): Tensor((D,), init="ones", std=0.1),
        ("mtp", "norm", "weight"): Tensor((D,), init="ones", std=0.1),
        ("mtp", "markov_head", "embed", "weight"): Tensor((V, r)),
        ("mtp", "markov_head", "head", "weight"): Tensor((V, r), dtype=F32, std=r ** -0.5),
        ("mtp", "confidence_head", "proj", "weight"): Tensor((1, D + r), dtype=F32, std=(D + r) ** -0.5),
    })
    return {k: replace(v, axes=(None,) * len(v.shape)) for k, v in t.items()}


def tensor_specs(cfg: ModelConfig) -> dict[tuple, Tensor]:
    """Every logical tensor with its shape, storage format, init and logical axes (see dsv41_jax.sharding)."""
    D, L, d = cfg.dim, cfg.n_layers, cfg.head_dim
    qL = cfg.q_lora_rank
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    t: dict[tuple, Tensor] = {
        ("embed", "weight"): Tensor((cfg.vocab_size, D), axes=("vocab", "embed")),
        ("norm", "weight"): Tensor((D,), init="ones", std=0.1, axes=("embed",)),
        ("head", "weight"): Tensor((cfg.vocab_size, D), dtype=F32, std=D ** -0.5, axes=("vocab", "embed")),
    }
    t.update({("layers", *k): v for k, v in _block_tensors(cfg, (L,), ("layers",), cfg.n_routed_experts).items()})
    _, counts = source_slots(cfg)
    for key, n in counts.items():
        k = (n,)
        if key.startswith("src"):
            ratio = int(key[-1])
            ks = ("kv_sources",)
            t[(key, "compressor", "wkv")] = Tensor((*k, d, D), std=D ** -0.5, axes=(*ks, "kv_latent", "embed"))
            if ratio > 1:
                t[(key, "compressor", "wgate")] = Tensor((*k, d, D), std=D ** -0.5, axes=(*ks, "kv_latent", "embed"))
            t[(key, "compressor", "norm")] = Tensor((*k, d), init="ones", std=0.1, axes=(*ks, "kv_latent"))
            t[(key, "indexer", "wk")] = Tensor((*k, di, d), std=d ** -0.5, axes=(*ks, "index_dim", "kv_latent"))
            t[(key, "indexer", "k_norm")] = Tensor((*k, di), init="ones", std=0.1, axes=(*ks, "index_dim"))
        t[(key, "indexer", "wq_b")] = _lin(k, Hi * di, qL, ("index_sources", "index_heads", "q_lora"))
        t[(key, "indexer", "weights_proj")] = Tensor((*k, Hi, D), std=D ** -0.5,
                                                     axes=("index_sources", "index_head_weights", "embed"))
    lay = cfg.engram_layout
    if lay is not None:
        cols = lay.n_cols * lay.head_dim
        for i, rows in enumerate(cfg.engram_rows):
            t[("engram", i, "embed")] = Tensor((rows, lay.head_dim), "table", axes=("engram_rows", None))
            t[("engram", i, "wkv")] = _lin((), D * (cfg.hc_mult + 1), cols, ("engram_out", "engram_in"))
            t[("engram", i, "q_weight")] = Tensor((cfg.hc_mult, D), init="ones", std=0.1, axes=("hc", "embed"))
            t[("engram", i, "k_weight")] = Tensor((cfg.hc_mult, D), init="ones", std=0.1, axes=("hc", "embed"))
    t.update(draft_tensor_specs(cfg))
    return t


def leaves_of(cfg: ModelConfig, path: tuple, t: Tensor) -> dict[tuple, Leaf]:
    n = 1
    for x in t.shape:
        n *= x
    ax = t.axes
    fp8 = cfg.weight_format == "fp8"
    *lead, out, inp = t.shape if len(t.shape) >= 2 else (None, *t.shape)
    if t.fmt == "lin" and fp8:
        sc = (*lead, -(-out // 32), -(-inp // 32))
        return {path + ("weight",): Leaf(t.shape, jnp.float8_e4m3fn, "weight", n, ax),
                path + ("scale",): Leaf(sc, jnp.float8_e8m0fnu, "scale", 0, ax)}
    if t.fmt == "exp" and fp8:
        return {path + ("weight",): Leaf((*lead, out, inp // 2), jnp.uint8, "weight", n, ax),
                path + ("scale",): Leaf((*lead, out, inp // 32), jnp.float8_e8m0fnu, "scale", 0, ax)}
    if t.fmt == "table":
        if fp8:
            return {path + ("weight",): Leaf(t.shape, jnp.float8_e4m3fn, "engram_table", n, ax),
                    path + ("scale",): Leaf((*lead, out, inp // 32), jnp.float8_e8m0fnu, "scale", 0, ax)}
        return {path + ("weight",): Leaf(t.shape, BF16, "engram_table", n, ax)}
    if t.fmt in ("lin", "exp"):
        return {path + ("weight",): Leaf(t.shape, BF16, "weight", n, ax)}
    return {path: Leaf(t.shape, t.dtype, "weight", n, ax)}


def param_specs(cfg: ModelConfig) -> dict[tuple, Leaf]:
    out = {}
    for path, t in tensor_specs(cfg).items():
        out.update(leaves_of(cfg, path, t))
    return out


def num_params(cfg: ModelConfig) -> int:
    """Backbone parameters (logical elements; FP8/FP4 scales, Engram tables and the DSpark draft excluded)."""
    return sum(s.logical_size for p, s in param_specs(cfg).items()
               if s.role not in ("scale", "engram_table") and p[0] != "mtp")


def num_draft_params(cfg: ModelConfig) -> int:
    """The DSpark draft's own parameters (it shares the backbone's embedding and LM head)."""
    return sum(s.logical_size for p, s in param_specs(cfg).items() if s.role != "scale" and p[0] == "mtp")


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _to_lists(tree):
    """engram: {0: ..., 1: ...} -> [..., ...] (ordered by Engram layer)."""
    if isinstance(tree, dict):
        if tree and all(isinstance(k, int) for k in tree):
            return [_to_lists(tree[i]) for i in range(len(tree))]
        return {k: _to_lists(v) for k, v in tree.items()}
    return tree


def _init_tensor(cfg, key, t: Tensor, path) -> dict:
    fp8 = cfg.weight_format == "fp8"
    # large bf16 tensors are drawn in bf16 directly (no f32 temporary the size of all experts)
    gen = BF16 if (not fp8 and t.fmt in ("lin", "exp", "table")) else F32
    if t.init == "ones":
        v = 1.0 + t.std * jax.random.normal(key, t.shape, F32)
    elif t.init == "uniform":
        v = jax.random.uniform(key, t.shape, F32, t.lo, t.hi)
    else:
        v = (jnp.asarray(t.std, gen) * jax.random.normal(key, t.shape, gen)).astype(gen)
    if path[-1] == "wo_a" and fp8:  # stored FP8 in the checkpoint, run in bf16: keep it FP8-representable
        v = quant.dequantize_weight_fp8(*quant.quantize_weight_fp8(v), F32)
    if t.fmt == "dense" and t.dtype == F32 and (path[0] in ("head", "src_r1", "src_r2") or path[:2] in BF16_STORED):
        v = v.astype(BF16)  # the checkpoint stores these in bf16
    if t.fmt == "lin" and fp8:
        w, s = quant.quantize_weight_fp8(v)
        return {path + ("weight",): w, path + ("scale",): s}
    if t.fmt == "exp" and fp8:
        w, s = quant.quantize_weight_fp4(v)
        return {path + ("weight",): w, path + ("scale",): s}
    if t.fmt == "table" and fp8:
        q, codes = quant.fp8_encode(v, 32)
        return {path + ("weight",): q, path + ("scale",): jax.lax.bitcast_convert_type(codes, jnp.float8_e8m0fnu)}
    if t.fmt in ("lin", "exp", "table"):
        return {path + ("weight",): v.astype(BF16)}
    return {path: v.astype(t.dtype)}


BF16_STORED = {("mtp", "markov_head"), ("mtp", "confidence_head")}  # f32 in the model, bf16 in the checkpoint


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Seeded random parameters (traceable: wrap in jax.jit to build them directly on device)."""
    specs = tensor_specs(cfg)
    keys = jax.random.split(jax.random.key(seed), len(specs))
    tree: dict = {}
    for key, (path, t) in zip(keys, specs.items()):
        for p, v in _init_tensor(cfg, key, t, path).items():
            _set(tree, p, v)
    return _to_lists(tree)


def abstract_params(cfg: ModelConfig) -> dict:
    """The parameter tree as jax.ShapeDtypeStruct leaves (no memory)."""
    tree: dict = {}
    for path, leaf in param_specs(cfg).items():
        _set(tree, path, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return _to_lists(tree)


def param_axes(cfg: ModelConfig) -> dict:
    """The parameter tree with each leaf's logical axes (a tuple of names / None, one per dim) as the leaf:
    what `DSV41` attaches to its nnx.Params and what the checkpoint code maps onto a mesh."""
    tree: dict = {}
    for path, leaf in param_specs(cfg).items():
        _set(tree, path, AxisNames(leaf.axes))
    return _to_lists(tree)


class AxisNames(tuple):
    """A leaf's logical axis names. An (unregistered) tuple subclass, which JAX treats as a leaf, so the axes
    tree lines up leaf-for-leaf with the parameter tree in jax.tree.map."""


# ----------------------------------------------------------------------------- weight access
def lin_weight(p: dict, dtype=BF16):
    """Dequantized [.., out, in] weight of a linear (FP8 block-32 or plain)."""
    if "scale" in p:
        return quant.dequantize_weight_fp8(p["weight"], p["scale"], dtype)
    return p["weight"].astype(dtype)


def expert_weight(p: dict, dtype=BF16):
    """A routed expert's weight in `dtype`: packed MXFP4 bytes dequantized, or a float weight as is (a float
    weight next to a scale is a training view's already fake-quantized value, training.objective.qat_params)."""
    if "scale" in p and not jnp.issubdtype(p["weight"].dtype, jnp.floating):
        return quant.dequantize_weight_fp4(p["weight"], p["scale"], dtype)
    return p["weight"].astype(dtype)


def is_quantized(p: dict) -> bool:
    return "scale" in p
