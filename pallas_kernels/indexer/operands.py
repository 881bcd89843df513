"""The operands of one lightning-indexer scoring call, as one typed pytree from the ops seam to the kernel, and
the kernel's view of the paged index keys (its layout constants are the caller's page layout, static fields)."""

from __future__ import annotations

import jax

from pallas_kernels.common import heads, operands, static


@operands
class IndexerOperands:
    q: jax.Array = heads(2)  # [B, T, Hi, di] bf16 index queries (RoPE'd, FP4-representable)
    w: jax.Array = heads(2)  # [B, T, Hi] bf16 head weights
    blocks: jax.Array  # [B, T or 1, nb] int32 ascending entry-block ids to score, -1 = none
    visible: jax.Array  # [B, T] int32 entries visible to each row ((t + 1) // ratio)
    ratio: int = static()  # compress ratio of the source
    block_size: int = static(default=8)  # entries per block


@operands
class PagedIndexKV:
    pages: jax.Array  # [P, page_bytes] uint8 the page pool
    page_table: jax.Array  # [B, max_pages] int32 page ids per sequence
    region: jax.Array  # [] int32 byte offset of the source's index-key region inside a page
    page_tokens: int = static()  # token positions per page (the caller's layout)
    entry_bytes: int = static()  # bytes per index-key entry (the caller's layout: di/2 + di/32 for FP4)
