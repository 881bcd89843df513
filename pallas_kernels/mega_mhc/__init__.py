"""Mega-mHC: a sublayer boundary of single-pass mHC (hc-post, the next mixes with their Sinkhorn, hc-pre, RMSNorm,
FP8 quantisation) in one kernel (its jnp reference: dsv41_jax.layers.hc_boundary)."""

from pallas_kernels.mega_mhc.kernel import MhcBlocks, hc_boundary, pick_blocks

__all__ = ["MhcBlocks", "hc_boundary", "pick_blocks"]
