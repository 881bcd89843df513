"""Active-experts-only grouped GEMM for the routed MoE on bf16 / MXFP4 expert weights (see kernel.py)."""

from pallas_kernels.moe.block_sizes import MoeBlock, pick_moe_block
from pallas_kernels.moe.kernel import (
                                      grouped_matmul,
                                      grouped_swiglu,
                                      ref_grouped_matmul,
                                      ref_grouped_swiglu,
                                      tile_metadata,
)

__all__ = ["MoeBlock", "grouped_matmul", "grouped_swiglu", "pick_moe_block", "ref_grouped_matmul", "ref_grouped_swiglu",
           "tile_metadata"]
