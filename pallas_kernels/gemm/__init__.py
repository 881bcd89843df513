"""Small-M GEMM on bf16 / FP8 block-32 weights (see kernel.py)."""

from pallas_kernels.gemm.block_sizes import GemmBlock, pick_gemm_block
from pallas_kernels.gemm.kernel import matmul, matmul_f32x, ref_matmul, split_bf16x3

__all__ = ["GemmBlock", "matmul", "matmul_f32x", "pick_gemm_block", "ref_matmul", "split_bf16x3"]
