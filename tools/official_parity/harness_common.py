"""Shared helpers for the local DeepSeek-V4.1 reference harness (run_official.py, make_random_weights.py).

Builds the *unmodified* official Transformer from official/model.py with a JSON dict of ModelArgs
overrides, and handles the engram compressed-token-map (which upstream derives from a HF tokenizer).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from official import engram as official_engram  # noqa: E402
from official import model as official_model  # noqa: E402

ModelArgs = official_model.ModelArgs
Transformer = official_model.Transformer

QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)


def load_args(path: str) -> ModelArgs:
    with open(path) as f:
        overrides = json.load(f)
    fields = {f.name: f for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise SystemExit(f"unknown ModelArgs fields in {path}: {unknown}")
    # JSON has no tuples; the dataclass declares tuple[int, ...] for the per-layer lists
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    args = ModelArgs(**fixed)
    n_total = args.n_layers + (args.n_mtp_layers if args.dspark_block_size else 0)
    if len(args.compress_ratios) < n_total:
        raise SystemExit(f"compress_ratios has {len(args.compress_ratios)} entries, need >= {n_total}")
    return args


class _TokenizerJsonWrapper:
    """Minimal stand-in for a HF PreTrainedTokenizerFast: what build_compressed_token_map touches."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(path)

    def __len__(self):
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def install_engram_token_map(args: ModelArgs, token_map_npy: str | None = None, tokenizer_json: str | None = None):
    """Decide how NgramHashState gets its compressed token map. Returns the tokenizer to pass to
    Transformer (None unless --tokenizer-json) and a one-line description.

    - default: monkeypatch official.engram.build_compressed_token_map -> identity map of size
      vocab_size (requires engram_compressed_vocab_size == vocab_size).
    - token_map_npy: explicit int map of length vocab_size; compressed size = max + 1.
    - tokenizer_json: run the real upstream build_compressed_token_map on a tokenizer.json.
    """
    if not args.engram_layer_ids:
        return None, "engram off"
    if tokenizer_json:
        return _TokenizerJsonWrapper(tokenizer_json), f"real build_compressed_token_map on {tokenizer_json}"
    if token_map_npy:
        tmap = np.load(token_map_npy).astype(np.int64).tolist()
        size = int(max(tmap)) + 1
        desc = f"explicit token map {token_map_npy} (len {len(tmap)}, compressed size {size})"
    else:
        tmap, size = list(range(args.vocab_size)), args.vocab_size
        desc = f"identity token map (compressed size {size})"
    if size != args.engram_compressed_vocab_size:
        raise SystemExit(
            f"engram_compressed_vocab_size={args.engram_compressed_vocab_size} but the token map has "
            f"compressed size {size}; set them equal (identity map => vocab_size)"
        )
    official_engram.build_compressed_token_map = lambda tokenizer: (list(tmap), size)
    return None, desc


def build_model(args: ModelArgs, token_map_npy=None, tokenizer_json=None):
    torch.set_default_dtype(torch.bfloat16)
    tokenizer, desc = install_engram_token_map(args, token_map_npy, tokenizer_json)
    model = Transformer(args, tokenizer)
    model.eval()
    for i, blk in enumerate(model.layers):
        if blk.attn.indexer is not None:
            blk.attn.indexer._harness_layer_id = i
    return model, desc


def convert_for_param(name: str, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """File tensor -> tensor with the parameter's dtype. Quantized params accept either the native
    safetensors dtype (F8_E4M3 / F8_E8M0 / F4) or raw bytes (U8/I8) of the *stored* shape."""
    if p.dtype in QUANT_DTYPES:
        if t.dtype == p.dtype:
            out = t
        elif t.dtype in (torch.uint8, torch.int8):
            out = t.contiguous().view(torch.uint8).view(p.dtype)
        else:
            raise SystemExit(f"{name}: param is {p.dtype}; file has {t.dtype} (need native or uint8 bytes)")
    else:
        if not t.dtype.is_floating_point:
            raise SystemExit(f"{name}: param is {p.dtype}; file has non-float {t.dtype}")
        out = t.to(p.dtype)
    if tuple(out.shape) != tuple(p.shape):
        raise SystemExit(f"{name}: shape {tuple(out.shape)} (file {tuple(t.shape)} {t.dtype}) "
                         f"!= param {tuple(p.shape)}")
    return out


def load_weights(model: torch.nn.Module, path: str):
    from safetensors.torch import load_file

    raw = load_file(path)
    params = dict(model.state_dict())
    # the DSpark stages register the shared embed / head as submodules: their state-dict entries are aliases of
    # embed.weight / head.weight, which a checkpoint holds once
    for k in params:
        for alias in ("embed", "head"):
            if k.startswith("mtp.") and k.endswith(f".{alias}.weight") and k not in raw:
                raw[k] = raw[f"{alias}.weight"]
    missing = sorted(set(params) - set(raw))
    extra = sorted(set(raw) - set(params))
    if missing or extra:
        raise SystemExit(f"weights mismatch: missing={missing[:20]}{'...' if len(missing) > 20 else ''} "
                         f"unexpected={extra[:20]}{'...' if len(extra) > 20 else ''}")
    sd = {k: convert_for_param(k, raw[k], params[k]) for k in params}
    model.load_state_dict(sd, strict=True)  # in-place copy: keeps Linear.weight.scale aliasing intact
    # the fp8/fp4 Linear keeps its scale on .weight.scale too; make sure it is the loaded one
    for mod in model.modules():
        if isinstance(mod, official_model.Linear) and mod.scale is not None:
            assert mod.weight.scale is mod.scale


def reset_state(model):
    """Clear KV / compressor / engram caches so a new prefill starts from a clean state."""
    for name, buf in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("window_kv_cache", "compress_kv_cache", "k_cache", "kv_state"):
            buf.zero_()
        elif leaf == "score_state":
            buf.fill_(-torch.inf)
        elif name == "engram_hash.cache":
            buf.zero_()
    sa = official_model.shared_attn
    sa.compress_kv = sa.index_k = sa.topk_idxs = sa.candidates = None


def state_dict_listing(model) -> str:
    lines = []
    for k, v in model.state_dict().items():
        lines.append(f"{k}\t{list(v.shape)}\t{str(v.dtype).replace('torch.', '')}")
    return "\n".join(lines) + "\n"
