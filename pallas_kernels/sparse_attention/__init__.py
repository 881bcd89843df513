"""Paged sparse attention (DeepSeek-V4.1 CSA2 core: SWA ring window + top-k FP4 global KV + sink), Pallas Triton
kernel and pure-jnp reference; see kernel.py."""

from pallas_kernels.sparse_attention.block_sizes import BlockSizes
from pallas_kernels.sparse_attention.kernel import paged_sparse_attention, ref_paged_sparse_attention

__all__ = ["BlockSizes", "paged_sparse_attention", "ref_paged_sparse_attention"]
