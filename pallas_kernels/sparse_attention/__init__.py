"""Paged sparse attention (DeepSeek-V4.1 CSA2 core: SWA ring window + top-k FP4 global KV + sink), Pallas Triton
kernel (its jnp reference is the model's dsv41_jax.attention.sparse_attention); see kernel.py."""

from pallas_kernels.sparse_attention.block_sizes import BlockSizes
from pallas_kernels.sparse_attention.kernel import paged_sparse_attention
from pallas_kernels.sparse_attention.operands import PagedAttentionKV, SparseAttentionOperands

__all__ = ["BlockSizes", "PagedAttentionKV", "SparseAttentionOperands", "paged_sparse_attention"]
