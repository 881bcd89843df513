"""The one home of the KV cache's sizes: the page/block size and the byte size of every cache entry.

Everything that sizes KV memory (the config's accounting, the page layout, the engine's pools, the prefix
cache's block hashing) reads these, so the numbers cannot drift apart (MODEL.md §4):
- a page (and a prefix-cache block) covers `PAGE_TOKENS` = 64 token positions;
- a global latent entry (head_dim d): FP4 E2M1 packed two per byte + one E4M3 scale per 16 -> d/2 + d/16 bytes
  (288 at d = 512); with qdq off it is stored raw in the compute dtype;
- an index-key entry (index_head_dim di): FP4 packed + one UE8M0 scale per 32 -> di/2 + di/32 bytes (68 at 128);
- an SWA ring entry: FP8 E4M3 + one UE8M0 scale per 32 -> d + d/32 bytes (528 at d = 512).
"""

from __future__ import annotations

PAGE_TOKENS = 64  # token positions per global-KV page and per prefix-cache block

LATENT_SCALE_BLOCK = 16  # FP4 latents: one E4M3 scale per 16 elements
INDEX_SCALE_BLOCK = 32  # FP4 index keys: one UE8M0 scale per 32 elements
SWA_SCALE_BLOCK = 32  # FP8 SWA entries: one UE8M0 scale per 32 elements


def _raw_itemsize(cfg) -> int:
    return 2 if cfg.compute_dtype == "bfloat16" else 4


def latent_entry_bytes(cfg) -> int:
    d = cfg.head_dim
    return d // 2 + d // LATENT_SCALE_BLOCK if cfg.qdq else d * _raw_itemsize(cfg)


def index_entry_bytes(cfg) -> int:
    di = cfg.index_head_dim
    return di // 2 + di // INDEX_SCALE_BLOCK if cfg.qdq else di * _raw_itemsize(cfg)


def swa_entry_bytes(cfg) -> int:
    d = cfg.head_dim
    return d + d // SWA_SCALE_BLOCK if cfg.qdq else d * _raw_itemsize(cfg)


def fp4_latent_bytes(d: int) -> int:
    """Bytes of one FP4 latent entry whatever the qdq switch (the persisted format's accounting)."""
    return d // 2 + d // LATENT_SCALE_BLOCK


def fp4_index_bytes(di: int) -> int:
    return di // 2 + di // INDEX_SCALE_BLOCK


def fp8_swa_bytes(d: int) -> int:
    return d + d // SWA_SCALE_BLOCK


def pages_for(tokens: int) -> int:
    """Pages needed to hold `tokens` positions."""
    return -(-tokens // PAGE_TOKENS)
