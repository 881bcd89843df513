"""Model configuration: the hyperparameters of DeepSeek-V4.1-Flash and its scaled-down presets.

`ModelConfig` is a frozen dataclass whose field names follow the official reference `ModelArgs`
(`from_hf_config` below maps the official config.json names onto them). Presets:

- ``tiny``   CPU unit tests (seconds).
Every preset has a DSpark draft (dsv41_jax.dspark): tiny 2 stages of 4 experts, small 2 of 16, medium 3 of 16,
full the official 3 of 128 (top-3), all reading the inputs of the last three layers (tiny: 3, 5, 7).
- ``small``  ~240M parameters, GPU smoke runs.
- ``medium`` the real V4.1-Flash per-layer shapes and all 40 layers, 16 routed experts, small Engram
             tables, bf16 weights (fits one H200); its 3-stage DSpark draft has 16 experts per stage.
- ``full``   exact V4.1-Flash; for shapes, parameter and KV accounting.

Runtime switches that are not part of the checkpoint: ``qdq`` (all quantize-dequantize points on/off),
``compute_dtype`` (bfloat16 as the reference, float32 for exactness tests), ``weight_format``
(``fp8``: FP8 block-32 linears and MXFP4 routed experts as the official checkpoint; ``bf16``: plain).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from dsv41_jax import engram_hash, kv_format

KIND_SWA = "swa"  # ratio 0: sliding window only
KIND_SRC = "src"  # KV source (compressor) + index source owning the index keys
KIND_IDX = "idx"  # index source that scores the latest source's keys ("Reindex")
KIND_REUSE = "reuse"  # reads the latest source's KV and the latest index source's top-k


@dataclass(frozen=True)
class ModelConfig:
    name: str = field(default="custom", compare=False)
    vocab_size: int = 512
    dim: int = 64
    n_layers: int = 8
    n_heads: int = 4
    head_dim: int = 32
    rope_head_dim: int = 8
    q_lora_rank: int = 32
    o_groups: int = 2
    o_lora_rank: int = 32
    window_size: int = 8
    norm_eps: float = 1e-20
    # sparse attention
    compress_ratios: tuple[int, ...] = (0, 2, 2, 2, 1, 1, 1, 1)
    kv_source_layers: tuple[int, ...] = (1, 4)
    index_source_layers: tuple[int, ...] = (1, 4, 6)
    index_n_heads: int = 2
    index_head_dim: int = 32
    index_topk: int = 8
    candidate_source_layer: int = 4
    candidate_topk_blocks: int = 3
    candidate_block_size: int = 4
    # rope
    rope_theta: float = 10000.0
    compress_rope_theta: float = 40000.0
    original_seq_len: int = 0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    # moe
    n_routed_experts: int = 8
    n_activated_experts: int = 2
    n_shared_experts: int = 1
    moe_inter_dim: int = 64
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    score_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    # hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # engram
    engram_layer_ids: tuple[int, ...] = (1,)
    engram_num_embeddings: tuple[int, ...] = ()  # () = derived from the prime layout
    engram_max_ngram_size: int = 3
    engram_vocab_size: int = 101
    engram_n_heads: int = 2
    engram_head_dim: int = 32
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 512
    # DSpark draft (dsv41_jax.dspark): n_mtp_layers stages after the backbone; 0 stages or block 0 = no draft
    n_mtp_layers: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    # runtime
    max_seq_len: int = 256
    weight_format: str = "fp8"
    compute_dtype: str = "bfloat16"
    qdq: bool = True

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ presets
    @staticmethod
    def preset(name: str, **overrides) -> ModelConfig:
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}")
        return dataclasses.replace(_PRESETS[name], **overrides)

    def replace(self, **overrides) -> ModelConfig:
        return dataclasses.replace(self, **overrides)

    # ------------------------------------------------------------------ derived structure
    def layer_kind(self, layer: int) -> str:
        if self.compress_ratios[layer] == 0:
            return KIND_SWA
        if layer in self.kv_source_layers:
            return KIND_SRC
        if layer in self.index_source_layers:
            return KIND_IDX
        return KIND_REUSE

    @property
    def decoder_start(self) -> int:
        """First decoder layer: the ratio-1 KV source whose global KV the decoder shares (layer 20)."""
        r1 = [l for l in self.kv_source_layers if self.compress_ratios[l] == 1]
        return r1[0] if r1 else self.n_layers

    @property
    def n_decoder_layers(self) -> int:
        return self.n_layers - self.decoder_start

    def exact_tail_rows(self) -> int:
        """Decoder rows that reproduce the full forward at the last position: W + (L_dec-1)(W-1)."""
        w = self.window_size
        return w + max(self.n_decoder_layers - 1, 0) * (w - 1)

    @property
    def has_draft(self) -> bool:
        """The config has a DSpark draft (the reference builds it iff dspark_block_size > 0)."""
        return self.n_mtp_layers > 0 and self.dspark_block_size > 0

    @property
    def draft_experts(self) -> tuple[int, int]:
        """(routed, activated) experts of the draft stages (the reference's get_moe_config)."""
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def engram_layout(self) -> engram_hash.EngramLayout | None:
        return engram_hash.layout_for(self)

    @property
    def engram_rows(self) -> tuple[int, ...]:
        if self.engram_num_embeddings:
            return tuple(self.engram_num_embeddings)
        lay = self.engram_layout
        return () if lay is None else lay.num_embeddings

    # ------------------------------------------------------------------ validation
    def validate(self):
        def bad(msg):
            raise ValueError(f"ModelConfig({self.name}): {msg}")

        L = self.n_layers
        if len(self.compress_ratios) != L:
            bad(f"compress_ratios has {len(self.compress_ratios)} entries for {L} layers")
        if any(r not in (0, 1, 2) for r in self.compress_ratios):
            bad("compress ratios must be 0, 1 or 2 (V4.1 has no other ratios)")
        for d, n in ((self.dim, "dim"), (self.head_dim, "head_dim"), (self.index_head_dim, "index_head_dim")):
            if d % 32:
                bad(f"{n}={d} must be a multiple of 32 (FP8/FP4 block size)")
        if (self.n_heads * self.head_dim) % self.o_groups:
            bad("n_heads*head_dim must divide by o_groups")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            bad("rope_head_dim must be even and <= head_dim")
        if self.weight_format not in ("fp8", "bf16"):
            bad(f"weight_format {self.weight_format!r} not in ('fp8', 'bf16')")
        if self.compute_dtype not in ("bfloat16", "float32"):
            bad(f"compute_dtype {self.compute_dtype!r} not in ('bfloat16', 'float32')")
        if self.score_func != "sqrtsoftplus":
            bad("only score_func='sqrtsoftplus' (V4.1) is implemented")
        if self.n_shared_experts != 1:
            bad("V4.1 has exactly one shared expert")
        for l in self.kv_source_layers:
            if not 0 <= l < L or self.compress_ratios[l] == 0:
                bad(f"kv source layer {l} must exist and have a compress ratio")
            if l not in self.index_source_layers:
                bad(f"kv source layer {l} must also be an index source")
        for l in self.index_source_layers:
            if not 0 <= l < L or self.compress_ratios[l] == 0:
                bad(f"index source layer {l} must exist and have a compress ratio")
        # every compressed layer reads the latest source of its own ratio and the latest index source
        src_ratio, have_idx = None, False
        for l in range(L):
            r = self.compress_ratios[l]
            if l in self.kv_source_layers:
                src_ratio = r
            if l in self.index_source_layers:
                have_idx = True
            if r and (src_ratio != r or not have_idx):
                bad(f"layer {l} (ratio {r}) has no preceding KV source of the same ratio / index source")
        if self.decoder_start < L:
            if any(e >= self.decoder_start for e in self.engram_layer_ids):
                bad("the decoder band must contain no Engram layer")
            if any(r != 1 for r in self.compress_ratios[self.decoder_start:]):
                bad("every decoder layer must have ratio 1")
        c = self.candidate_source_layer
        if c >= 0:
            if c not in self.kv_source_layers:
                bad("the candidate source must be a KV source")
            if self.candidate_topk_blocks * self.candidate_block_size < self.index_topk:
                bad("candidate_topk_blocks*candidate_block_size must be >= index_topk")
        if self.has_draft:
            if not self.dspark_target_layer_ids:
                bad("a DSpark draft needs dspark_target_layer_ids")
            if any(not 0 <= t < L for t in self.dspark_target_layer_ids):
                bad(f"dspark_target_layer_ids {self.dspark_target_layer_ids} must be backbone layers")
            if tuple(sorted(set(self.dspark_target_layer_ids))) != tuple(self.dspark_target_layer_ids):
                bad("dspark_target_layer_ids must be increasing")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size:
                bad("dspark_noise_token_id must be a token id")
            e, k = self.draft_experts
            if not 0 < k <= e:
                bad("the draft needs 0 < dspark_n_activated_experts <= dspark_n_routed_experts")
        for e in self.engram_layer_ids:
            if not 0 <= e < L:
                bad(f"engram layer {e} out of range")
        if self.engram_layer_ids:
            if self.engram_head_dim % 32:
                bad("engram_head_dim must be a multiple of 32 (FP8 scales per 32)")
            if self.engram_max_ngram_size < 2:
                bad("engram_max_ngram_size must be >= 2")
            if self.engram_num_embeddings and len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                bad("engram_num_embeddings must have one entry per engram layer")

    # ------------------------------------------------------------------ accounting
    def num_engram_table_params(self) -> int:
        return sum(self.engram_rows) * self.engram_head_dim

    def global_kv_bytes_per_token(self) -> float:
        """Persisted global KV per token: FP4 latents (e2m1 + E4M3 per 16) and FP4 index keys
        (e2m1 + UE8M0 per 32), each divided by its source's compression ratio (dsv41_jax.kv_format)."""
        entry = kv_format.fp4_latent_bytes(self.head_dim) + kv_format.fp4_index_bytes(self.index_head_dim)
        return float(sum(entry / self.compress_ratios[l] for l in self.kv_source_layers))

    def swa_kv_bytes_per_request(self) -> int:
        """SWA rings (FP8 + UE8M0 per 32) for every layer: bounded, whatever the context length."""
        return self.n_layers * self.window_size * kv_format.fp8_swa_bytes(self.head_dim)

    # ------------------------------------------------------------------ HF config
    @staticmethod
    def from_hf_config(path, **overrides) -> ModelConfig:
        """Read an official DeepSeek-V4.1 config.json (fields under text_config, or top level)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        raw = json.loads(p.read_text())
        return ModelConfig.from_hf_dict(raw, **overrides)

    @staticmethod
    def from_hf_dict(raw: dict, **overrides) -> ModelConfig:
        text = raw.get("text_config", raw)
        unknown = sorted(k for k in text if k not in _HF_FIELDS and k not in _HF_IGNORED)
        if unknown:
            raise ValueError(f"config.json: unknown text_config field(s) {unknown}")
        missing = sorted(k for k in _HF_REQUIRED if k not in text)
        if missing:
            raise ValueError(f"config.json: missing required field(s) {missing}")
        if text.get("num_key_value_heads", 1) != 1:
            raise ValueError("config.json: num_key_value_heads must be 1 (one shared latent)")
        if text.get("attention_bias", False):
            raise ValueError("config.json: attention_bias must be false")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError("config.json: hidden_act must be silu")
        if text.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError("config.json: topk_method must be noaux_tc")
        kw = {}
        if "n_mtp_layers" in text:  # the reference ModelArgs spelling of num_nextn_predict_layers
            kw["n_mtp_layers"] = text["n_mtp_layers"]
        for hf, ours in _HF_FIELDS.items():
            if hf in text and ours is not None:
                v = text[hf]
                kw[ours] = tuple(v) if isinstance(v, list) else v
        n_layers = kw["n_layers"]
        kw["compress_ratios"] = tuple(kw["compress_ratios"][:n_layers])
        rs = text.get("rope_scaling") or {}
        if rs:
            if rs.get("rope_type", rs.get("type", "yarn")) != "yarn":
                raise ValueError(f"config.json: unsupported rope_scaling {rs}")
            kw["rope_factor"] = float(rs.get("factor", 1.0))
            kw["beta_fast"] = int(rs.get("beta_fast", 32))
            kw["beta_slow"] = int(rs.get("beta_slow", 1))
            kw["original_seq_len"] = int(rs.get("original_max_position_embeddings", 0))
        q = raw.get("quantization_config") or {}
        kw["weight_format"] = "fp8" if q.get("quant_method") == "fp8" else "bf16"
        for k in ("rope_theta", "compress_rope_theta", "hc_eps", "norm_eps", "route_scale", "swiglu_limit"):
            if k in kw:
                kw[k] = float(kw[k])
        kw.update(overrides)
        return ModelConfig(name=overrides.get("name", "hf"), **{k: v for k, v in kw.items() if k != "name"})


# config.json text_config name -> ModelConfig field (None: validated elsewhere, not stored)
_HF_FIELDS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": None,
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank",
    "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups",
    "hidden_act": None,
    "swiglu_limit": "swiglu_limit",
    "rms_norm_eps": "norm_eps",
    "attention_bias": None,
    "max_position_embeddings": "max_seq_len",
    "rope_theta": "rope_theta",
    "rope_scaling": None,
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "topk_method": None,
    "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "route_scale",
    "sliding_window": "window_size",
    "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_token_id": "engram_pad_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
_HF_IGNORED = {
    "model_type", "architectures", "dtype", "torch_dtype", "transformers_version", "bos_token_id",
    "eos_token_id", "pad_token_id", "image_token_id", "tie_word_embeddings", "initializer_range",
    "use_cache", "quantization_config", "vision_config", "auto_map", "n_mtp_layers",
}
_HF_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "q_lora_rank", "o_lora_rank", "o_groups", "compress_ratios", "kv_source_layer_ids",
    "index_source_layer_ids", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "sliding_window", "hc_mult",
)


def _full() -> ModelConfig:
    return ModelConfig(
        name="full", vocab_size=129280, dim=5120, n_layers=40, n_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window_size=128, norm_eps=1e-20,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20, kv_source_layers=(2, 8, 14, 20),
        index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36), index_n_heads=32, index_head_dim=128,
        index_topk=512, candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
        rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=65536, rope_factor=16.0,
        beta_fast=32, beta_slow=1, n_routed_experts=384, n_activated_experts=6, n_shared_experts=1,
        moe_inter_dim=2304, route_scale=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20,
        hc_eps=1e-6, engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682),
        engram_max_ngram_size=4, engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256,
        engram_pad_id=2, engram_compressed_vocab_size=99092, n_mtp_layers=3, dspark_block_size=5,
        dspark_noise_token_id=128799, dspark_target_layer_ids=(37, 38, 39), dspark_markov_rank=256,
        dspark_n_routed_experts=128, dspark_n_activated_experts=3, max_seq_len=1048576,
        weight_format="fp8",
    )


_PRESETS = {
    "tiny": ModelConfig(name="tiny", n_mtp_layers=2, dspark_block_size=5, dspark_noise_token_id=511,
                        dspark_target_layer_ids=(3, 5, 7), dspark_markov_rank=32, dspark_n_routed_experts=4,
                        dspark_n_activated_experts=2),
    "small": ModelConfig(
        name="small", vocab_size=32768, dim=768, n_layers=16, n_heads=8, head_dim=128, rope_head_dim=32,
        q_lora_rank=384, o_groups=4, o_lora_rank=256, window_size=128,
        compress_ratios=(0, 0) + (2,) * 6 + (1,) * 8, kv_source_layers=(2, 5, 8),
        index_source_layers=(2, 5, 8, 10, 12, 14), index_n_heads=8, index_head_dim=64, index_topk=256,
        candidate_source_layer=8, candidate_topk_blocks=512, candidate_block_size=8,
        rope_theta=10000.0, compress_rope_theta=160000.0, original_seq_len=16384, rope_factor=4.0,
        n_routed_experts=16, n_activated_experts=2, moe_inter_dim=256, engram_layer_ids=(1, 5),
        engram_max_ngram_size=3, engram_n_heads=4, engram_head_dim=64, engram_vocab_size=20011,
        engram_compressed_vocab_size=32768, max_seq_len=8192, weight_format="fp8", n_mtp_layers=2,
        dspark_block_size=5, dspark_noise_token_id=32767, dspark_target_layer_ids=(13, 14, 15),
        dspark_markov_rank=128, dspark_n_routed_experts=16, dspark_n_activated_experts=2,
    ),
    "medium": dataclasses.replace(
        _full(), name="medium", n_routed_experts=16, engram_num_embeddings=(), engram_vocab_size=20011,
        engram_compressed_vocab_size=129280, dspark_n_routed_experts=16, max_seq_len=65536, weight_format="bf16",
    ),
    "full": _full(),
}

