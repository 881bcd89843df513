"""The one home of the KV cache's layout: the page/block size and the byte format of every cache entry (sizes,
pack and unpack).

Everything that sizes or encodes KV memory (the config's accounting, the page layout, the engine's pools, the
prefix cache's block hashing, the KV-state strategies of dsv41_jax.kv_cache, and through their static arguments
the Pallas kernels) reads these, so the formats cannot drift apart (docs/ARCHITECTURE.md, "KV cache"):
- a page (and a prefix-cache block) covers `PAGE_TOKENS` = 64 token positions;
- a global latent entry (head_dim d): FP4 E2M1 packed two per byte + one E4M3 scale per 16 -> d/2 + d/16 bytes
  (288 at d = 512); with qdq off it is stored raw in the compute dtype;
- an index-key entry (index_head_dim di): FP4 packed + one UE8M0 scale per 32 -> di/2 + di/32 bytes (68 at 128);
- an SWA ring entry: FP8 E4M3 + one UE8M0 scale per 32 -> d + d/32 bytes (528 at d = 512).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import quant

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


# ----------------------------------------------------------------------------- byte formats
def _raw_dtype(cfg):
    return jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else jnp.float32


def swa_pack(cfg, x):
    """SWA entries [..., d] (FP8-representable when qdq) -> bytes [..., swa_entry_bytes]: d E4M3 bytes then d/32
    UE8M0 scale bytes; with qdq off the raw compute-dtype bytes."""
    if cfg.qdq:
        q, codes = quant.fp8_pack(x, SWA_SCALE_BLOCK)
        return jnp.concatenate([q, codes], axis=-1)
    return jax.lax.bitcast_convert_type(x.astype(_raw_dtype(cfg)), jnp.uint8).reshape(*x.shape[:-1], -1)


def swa_unpack(cfg, b):
    """`swa_pack`'s inverse (exact), in the compute dtype."""
    d, dt = cfg.head_dim, _raw_dtype(cfg)
    if cfg.qdq:
        return quant.fp8_unpack(b[..., :d], b[..., d:], SWA_SCALE_BLOCK, dt)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], d, jnp.dtype(dt).itemsize), dt)


def entry_pack(fmt: str, kind: str, x):
    """A global entry (kind "lat": a latent, "idx": an index key) -> bytes. fmt "fp4": E2M1 pairs (low nibble =
    even element) then the scales (E4M3 per 16 for latents, UE8M0 per 32 for index keys); else the raw bytes of
    dtype `fmt`."""
    if fmt == "fp4":
        if kind == "lat":
            p, s = quant.fp4_pack(x, LATENT_SCALE_BLOCK, "e4m3")
        else:
            p, s = quant.fp4_pack(x, INDEX_SCALE_BLOCK, "ue8m0")
        return jnp.concatenate([p, s], axis=-1)
    b = jax.lax.bitcast_convert_type(x.astype(jnp.dtype(fmt)), jnp.uint8)
    return b.reshape(*x.shape[:-1], -1)


def entry_unpack(fmt: str, kind: str, b, dim: int, out_dtype):
    """`entry_pack`'s inverse (exact) for entries of `dim` elements."""
    if fmt == "fp4":
        half = dim // 2
        if kind == "lat":
            return quant.fp4_unpack(b[..., :half], b[..., half:], LATENT_SCALE_BLOCK, "e4m3", out_dtype)
        return quant.fp4_unpack(b[..., :half], b[..., half:], INDEX_SCALE_BLOCK, "ue8m0", out_dtype)
    dt = jnp.dtype(fmt)
    v = b.reshape(*b.shape[:-1], dim, dt.itemsize)
    return jax.lax.bitcast_convert_type(v, dt).astype(out_dtype)
