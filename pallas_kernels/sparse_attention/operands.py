"""The operands of one CSA2 attention call, as one typed pytree from the model to the kernel.

`SparseAttentionOperands` is what the model produces per layer and what every implementation reads (the XLA
reference branch of dsv41_jax.ops and the Pallas kernel): the ops seam and the tensor-parallel shard_map pass
it whole (heads fields split, the rest replicated). `PagedAttentionKV` is the kernel's view of the engine's KV
storage (packed ring pool, page pool), built by the KV strategy; its layout constants arrive as static fields
from the caller's page layout (dsv41_jax.kv_format), the kernel keeps none of its own.
"""

from __future__ import annotations

import jax

from pallas_kernels.common import heads, operands, static


@operands
class SparseAttentionOperands:
    q: jax.Array = heads(2)  # [B, T, H, d] query heads (RoPE'd), compute dtype
    chunk_kv: jax.Array  # [B, T, d] the chunk's own SWA entries (FP8-representable)
    pos0: jax.Array  # [B] int32 position of row 0 (row i is at pos0 + i)
    clip: jax.Array  # [B] int32 SWA clip: window positions below it are never read
    sel: jax.Array | None = None  # [B, T, k] int32 selected global entries, -1 = none (None: SWA-only layer)
    sink: jax.Array = heads(0)  # [H] f32 attention-sink logits
    layer: jax.Array  # [] int32 the layer (its rings)
    src: jax.Array  # [] int32 KV source slot of `sel` (the KV strategy turns it into a page region)
    freqs: jax.Array | None = None  # [rope_dim / 2] f32 the layer's RoPE frequencies: the output leaves with the
    # inverse rotation at its query position (dsv41_jax.rope.apply_rope(inverse=True)); None: no rotation
    ratio: int = static()  # compress ratio of `sel`'s source (1 for SWA-only layers)
    fresh: bool = static(default=False)  # a chunk from position 0 with empty rings: the reference's prefill
    # window order (the XLA branch only; the kernel serves continuation chunks and decode)


@operands
class PagedAttentionKV:
    ring: jax.Array  # [L, R, W, e] uint8 packed SWA ring pool (E4M3 bytes, then UE8M0 per 32)
    ring_slot: jax.Array  # [B] int32 ring-pool row of every sequence
    pages: jax.Array | None = None  # [P, page_bytes] uint8 the page pool (None: SWA-only layer)
    page_table: jax.Array | None = None  # [B, max_pages] int32 page ids per sequence
    region: jax.Array | None = None  # [] int32 byte offset of the source's latent region inside a page
    page_tokens: int = static()  # token positions per page (the caller's layout)
    entry_bytes: int = static()  # bytes per latent entry (the caller's layout: d/2 + d/16 for FP4)
