"""Small-M GEMM on bf16 / FP8 block-32 weights (see kernel.py)."""

from pallas_kernels.gemm.block_sizes import GemmBlock, pick_gemm_block
from pallas_kernels.gemm.kernel import matmul, ref_matmul

__all__ = ["GemmBlock", "matmul", "pick_gemm_block", "ref_matmul"]
