"""The official ``config.json`` of a checkpoint: writing it from a ModelConfig, reading it with file names in errors.

`to_hf_dict(cfg)` is the inverse of `ModelConfig.from_hf_dict`: ``from_hf_dict(to_hf_dict(cfg)) == cfg`` for
every field that a checkpoint describes (all but the runtime switches ``compute_dtype`` / ``qdq`` and the
``name``, a compare=False field). Layout as the official file: top-level model type and
``quantization_config`` (present iff weight_format == "fp8": FP8 e4m3 32x32 blocks with UE8M0 scales, MXFP4
experts), hyperparameters under ``text_config``; an empty ``engram_num_embeddings`` (derived from the prime
layout) is left out.
"""

from __future__ import annotations

import json
from pathlib import Path

from checkpoints.safetensors_io import CheckpointError
from dsv41_jax.config import _HF_FIELDS, ModelConfig

CONFIG_NAME = "config.json"
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
_FIXED = {"num_key_value_heads": 1, "hidden_act": "silu", "attention_bias": False, "topk_method": "noaux_tc"}
_DERIVED = {"rope_scaling"}  # written from several ModelConfig fields


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def to_hf_dict(cfg: ModelConfig) -> dict:
    """The official config.json contents for `cfg` (text_config + quantization_config)."""
    text = {"model_type": "deepseek_v41_text"}
    for hf, ours in _HF_FIELDS.items():
        if hf in _FIXED:
            text[hf] = _FIXED[hf]
        elif ours is not None:
            v = getattr(cfg, ours)
            if hf == "engram_num_embeddings" and not v:
                continue
            text[hf] = _plain(v)
        elif hf not in _DERIVED:
            raise AssertionError(f"no writer for config field {hf}")  # keep in step with config._HF_FIELDS
    text["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                            "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len}
    raw = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16"}
    if cfg.weight_format == "fp8":
        raw["quantization_config"] = dict(QUANTIZATION)
    raw["text_config"] = text
    return raw


def is_quantized(raw: dict) -> bool:
    q = raw.get("quantization_config") or {}
    return q.get("quant_method") == "fp8"


def write_hf_config(cfg: ModelConfig, directory) -> Path:
    p = Path(directory) / CONFIG_NAME
    p.write_text(json.dumps(to_hf_dict(cfg), indent=1) + "\n")
    return p


def read_hf_config(directory, **overrides) -> tuple[ModelConfig, dict]:
    """(ModelConfig, raw dict) from DIR/config.json; any problem is a CheckpointError naming the file."""
    p = Path(directory) / CONFIG_NAME
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: unreadable config ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{p}: not a JSON object")
    q = raw.get("quantization_config") or {}
    if q and q.get("quant_method") == "fp8":
        want = {k: QUANTIZATION[k] for k in ("weight_block_size", "scale_fmt")}
        got = {k: q.get(k, want[k]) for k in want}
        if got != want:
            raise CheckpointError(f"{p}: unsupported quantization_config {q} (need {want})")
    elif q:
        raise CheckpointError(f"{p}: unsupported quantization_config {q}")
    try:
        cfg = ModelConfig.from_hf_dict(raw, **overrides)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{p}: {e}") from None
    return cfg, raw
