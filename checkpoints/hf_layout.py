"""The official checkpoint's tensor names and formats, mapped onto our parameter tree.

Every official tensor (reference module parameter names, no ``model.`` prefix) corresponds to one slice
of one of our stacked leaves. `checkpoint_entries(cfg)` lists them with their stored dtype and shape:

- FP8 E4M3 + ``.scale`` F8_E8M0 per 32x32 block: attention wq_a / wq_b / wkv / wo_a / wo_b, shared experts,
  indexer wq_b, Engram wkv (wo_a is dequantized to bf16 on import: the model runs it in bf16);
- routed experts: I8 [out, in/2] (two E2M1 per byte, low nibble = even element) + ``.scale`` F8_E8M0 [out, in/32];
- Engram tables: F8_E4M3 [rows, head_dim] + ``.scale`` F8_E8M0 [rows, head_dim/32];
- BF16: embed, head, norms, compressors, indexer wk / weights_proj, gate weight, Engram q/k weights;
- F32: attn_sink, gate bias, mHC fn / base / scale.

A checkpoint without ``quantization_config`` (what `make_hf` writes for weight_format "bf16") has the same
names with every FP8/FP4 weight stored as BF16 [out, in] and no ``.scale`` tensors. `stored_tensors(cfg,
quantized)` is the complete list of what a checkpoint must hold, the DSpark draft's ``mtp.*`` tensors included
when the config has a draft (`draft_entries`); names under `IGNORED_PREFIXES` (vision; ``mtp.`` when the config
has no draft) and the gate's ``bias_vl`` (image tokens) are accepted and skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from dsv41_jax.config import KIND_SRC, ModelConfig
from dsv41_jax.params import source_slots

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
I8 = np.dtype(np.int8)
U8 = np.dtype(np.uint8)
IGNORED_PREFIXES = ("mtp.", "vision.", "aligner.")
IGNORED_SUFFIXES = (".ffn.gate.bias_vl",)


@dataclass(frozen=True)
class Entry:
    name: str  # official tensor name
    path: tuple  # our leaf path
    index: tuple  # index into the stacked leaf
    fmt: str  # dense | fp8 (weight+scale) | fp4 (expert weight+scale) | table (fp8 rows + scale)
    dtype: np.dtype  # stored dtype of the weight (dense) in the checkpoint
    shape: tuple  # logical shape of the weight


def _ceil(a, b):
    return -(-a // b)


def _attn_entries(cfg: ModelConfig, add, root: tuple):
    """mHC, norms and the attention core (no compressor / indexer) of one block whose leaves sit under `root`."""
    D, H, d, qL = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    G, oL = cfg.o_groups, cfg.o_lora_rank
    M, hcD = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * D
    for sub in ("attn", "ffn"):
        add(f"hc_{sub}_fn", root + (f"hc_{sub}_fn",), "dense", F32, (M, hcD))
        add(f"hc_{sub}_base", root + (f"hc_{sub}_base",), "dense", F32, (M,))
        add(f"hc_{sub}_scale", root + (f"hc_{sub}_scale",), "dense", F32, (3,))
    add("attn_norm.weight", root + ("attn_norm",), "dense", BF16, (D,))
    add("ffn_norm.weight", root + ("ffn_norm",), "dense", BF16, (D,))
    a = root + ("attn",)
    add("attn.attn_sink", a + ("attn_sink",), "dense", F32, (H,))
    add("attn.wq_a.weight", a + ("wq_a",), "fp8", E4M3, (qL, D))
    add("attn.q_norm.weight", a + ("q_norm",), "dense", BF16, (qL,))
    add("attn.wq_b.weight", a + ("wq_b",), "fp8", E4M3, (H * d, qL))
    add("attn.wkv.weight", a + ("wkv",), "fp8", E4M3, (d, D))
    add("attn.kv_norm.weight", a + ("kv_norm",), "dense", BF16, (d,))
    add("attn.wo_a.weight", a + ("wo_a",), "fp8_to_bf16", E4M3, (G * oL, H * d // G))
    add("attn.wo_b.weight", a + ("wo_b",), "fp8", E4M3, (D, G * oL))


def _ffn_entries(cfg: ModelConfig, add, root: tuple, E: int, ix: tuple):
    """The MoE of one block (E routed experts, one shared) whose leaves sit under `root`, at stack index ix."""
    D, I = cfg.dim, cfg.moe_inter_dim
    f = root + ("ffn",)
    add("ffn.gate.weight", f + ("gate", "weight"), "dense", BF16, (E, D))
    add("ffn.gate.bias", f + ("gate", "bias"), "dense", F32, (E,))
    for e in range(E):
        for w, shp in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
            add(f"ffn.experts.{e}.{w}.weight", f + ("experts", w), "fp4", I8, shp, ix + (e,))
    for w, shp in (("w1", (I, D)), ("w2", (D, I)), ("w3", (I, D))):
        add(f"ffn.shared_experts.{w}.weight", f + ("shared", w), "fp8", E4M3, shp)


def checkpoint_entries(cfg: ModelConfig) -> list[Entry]:
    D, d = cfg.dim, cfg.head_dim
    Hi, di = cfg.index_n_heads, cfg.index_head_dim
    out = [Entry("embed.weight", ("embed", "weight"), (), "dense", BF16, (cfg.vocab_size, D)),
           Entry("norm.weight", ("norm", "weight"), (), "dense", BF16, (D,)),
           Entry("head.weight", ("head", "weight"), (), "dense", BF16, (cfg.vocab_size, D))]
    slots, _ = source_slots(cfg)
    eng = {l: i for i, l in enumerate(cfg.engram_layer_ids)}
    lay = cfg.engram_layout
    for l in range(cfg.n_layers):
        p = f"layers.{l}."
        ix = (l,)

        def add(name, path, fmt, dtype, shape, index=ix):
            out.append(Entry(p + name, path, index, fmt, dtype, shape))

        _attn_entries(cfg, add, ("layers",))
        if l in slots:
            key, s = slots[l]
            si = (s,)
            if cfg.layer_kind(l) == KIND_SRC:
                c = (key, "compressor")
                add("attn.compressor.wkv.weight", c + ("wkv",), "dense", BF16, (d, D), si)
                if cfg.compress_ratios[l] > 1:
                    add("attn.compressor.wgate.weight", c + ("wgate",), "dense", BF16, (d, D), si)
                add("attn.compressor.norm.weight", c + ("norm",), "dense", BF16, (d,), si)
                add("attn.indexer.wk.weight", (key, "indexer", "wk"), "dense", BF16, (di, d), si)
                add("attn.indexer.k_norm.weight", (key, "indexer", "k_norm"), "dense", BF16, (di,), si)
            add("attn.indexer.wq_b.weight", (key, "indexer", "wq_b"), "fp8", E4M3, (Hi * di, cfg.q_lora_rank), si)
            add("attn.indexer.weights_proj.weight", (key, "indexer", "weights_proj"), "dense", BF16, (Hi, D), si)
        _ffn_entries(cfg, add, ("layers",), cfg.n_routed_experts, ix)
        if l in eng:
            i = eng[l]
            g = ("engram", i)
            rows = cfg.engram_rows[i]
            add("engram.q_weight", g + ("q_weight",), "dense", BF16, (cfg.hc_mult, D), ())
            add("engram.k_weight", g + ("k_weight",), "dense", BF16, (cfg.hc_mult, D), ())
            add("engram.embed.weight", g + ("embed",), "table", E4M3, (rows, lay.head_dim), ())
            add("engram.wkv.weight", g + ("wkv",), "fp8", E4M3, (D * (cfg.hc_mult + 1), lay.n_cols * lay.head_dim),
                ())
    return out + draft_entries(cfg)


def draft_entries(cfg: ModelConfig) -> list[Entry]:
    """The DSpark draft's ``mtp.{s}.*`` tensors (none without a draft): every stage a block as the backbone's
    (no compressor / indexer / Engram, cfg.draft_experts routed experts); mtp.0 adds main_proj (FP8) and
    main_norm, the last stage norm, markov_head.{embed, head} [V, rank] and confidence_head.proj [1, D + rank]
    (BF16 in the checkpoint; the model holds the head and the confidence projection in f32). The reference
    module also registers the shared embed / head under every stage (aliases): the checkpoint does not hold them."""
    if not cfg.has_draft:
        return []
    D, V, r, S = cfg.dim, cfg.vocab_size, cfg.dspark_markov_rank, cfg.n_mtp_layers
    out: list[Entry] = []
    root = ("mtp", "layers")
    for st in range(S):
        p = f"mtp.{st}."

        def add(name, path, fmt, dtype, shape, index=(st,)):
            out.append(Entry(p + name, path, index, fmt, dtype, shape))

        _attn_entries(cfg, add, root)
        _ffn_entries(cfg, add, root, cfg.draft_experts[0], (st,))
        if st == 0:
            nt = len(cfg.dspark_target_layer_ids)
            add("main_proj.weight", ("mtp", "main_proj"), "fp8", E4M3, (D, nt * D), ())
            add("main_norm.weight", ("mtp", "main_norm", "weight"), "dense", BF16, (D,), ())
        if st == S - 1:
            add("norm.weight", ("mtp", "norm", "weight"), "dense", BF16, (D,), ())
            add("markov_head.embed.weight", ("mtp", "markov_head", "embed", "weight"), "dense", BF16, (V, r), ())
            add("markov_head.head.weight", ("mtp", "markov_head", "head", "weight"), "dense", BF16, (V, r), ())
            add("confidence_head.proj.weight", ("mtp", "confidence_head", "proj", "weight"), "dense", BF16,
                (1, D + r), ())
    return out


def scale_shape(e: Entry) -> tuple | None:
    if e.fmt == "dense":
        return None
    out, inp = e.shape[-2], e.shape[-1]
    if e.fmt in ("fp8", "fp8_to_bf16"):
        return (_ceil(out, 32), _ceil(inp, 32))
    if e.fmt in ("fp4", "table"):
        return (out, inp // 32)
    return None


def stored_shape(e: Entry) -> tuple:
    return (e.shape[0], e.shape[1] // 2) if e.fmt == "fp4" else e.shape


@dataclass(frozen=True)
class Stored:
    """One tensor of the checkpoint file: its name, dtype and shape, and the entry (and role) it serves."""
    name: str
    dtype: np.dtype
    shape: tuple
    entry: Entry
    role: str  # weight | scale

    @property
    def accepted(self) -> tuple:
        """Stored dtypes accepted for this tensor (packed FP4 bytes may be written as I8 or U8)."""
        return (I8, U8) if self.dtype == I8 else (self.dtype,)


def scale_name(e: Entry) -> str:
    return e.name[:-len("weight")] + "scale"


def stored_tensors(cfg: ModelConfig, quantized: bool = True) -> list[Stored]:
    """Every tensor a checkpoint of `cfg` holds, in checkpoint order (weight, then its scale)."""
    out = []
    for e in checkpoint_entries(cfg):
        if e.fmt == "dense":
            out.append(Stored(e.name, e.dtype, e.shape, e, "weight"))
        elif not quantized:
            out.append(Stored(e.name, BF16, e.shape, e, "weight"))
        else:
            out.append(Stored(e.name, e.dtype, stored_shape(e), e, "weight"))
            out.append(Stored(scale_name(e), E8M0, scale_shape(e), e, "scale"))
    return out


def is_ignored(name: str) -> bool:
    """Tensors of the official checkpoint that a text-only model does not use."""
    return name.startswith(IGNORED_PREFIXES) or name.endswith(IGNORED_SUFFIXES)


def _leaf(params, path):
    node = params
    for k in path:
        node = node[k]
    return node


def export_tensors(cfg: ModelConfig, params, module_format: bool = False):
    """Yield (official name, numpy array) in checkpoint formats, one tensor at a time.

    module_format=True keeps wo_a in bf16 (as the reference module holds it after its converter)."""
    from dsv41_jax import quant

    for e in checkpoint_entries(cfg):
        node = _leaf(params, e.path)
        if e.fmt == "dense":
            yield e.name, np.asarray(node[e.index]).astype(e.dtype)
            continue
        if e.fmt == "fp8_to_bf16" and module_format:
            yield e.name, np.asarray(node[e.index]).astype(BF16)
            continue
        if e.fmt in ("fp8", "fp8_to_bf16"):
            if isinstance(node, dict) and "scale" in node:
                w, s = node["weight"][e.index], node["scale"][e.index]
            else:
                w = node["weight"][e.index] if isinstance(node, dict) else node[e.index]
                w, s = quant.quantize_weight_fp8(w)
            yield e.name, np.asarray(w).astype(E4M3)
            yield e.name[:-len("weight")] + "scale", np.asarray(s).astype(E8M0)
        elif e.fmt == "fp4":
            if "scale" in node:
                w, s = node["weight"][e.index], node["scale"][e.index]
            else:
                w, s = quant.quantize_weight_fp4(node["weight"][e.index])
            yield e.name, np.asarray(w).view(I8)
            yield e.name[:-len("weight")] + "scale", np.asarray(s).astype(E8M0)
        elif e.fmt == "table":
            if "scale" in node:
                w, s = node["weight"], node["scale"]
            else:
                import jax
                q, codes = quant.fp8_encode(node["weight"], 32)
                w, s = q, jax.lax.bitcast_convert_type(codes, ml_dtypes.float8_e8m0fnu)
            yield e.name, np.asarray(w).astype(E4M3)
            yield e.name[:-len("weight")] + "scale", np.asarray(s).astype(E8M0)
