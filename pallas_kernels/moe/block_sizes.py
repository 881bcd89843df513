"""Tile choice for the active-experts grouped GEMM (pallas_kernels.moe.kernel.grouped_matmul).

A program computes one (row tile of one active expert) x (N tile). At decode an expert holds a few rows, so
bm is the dot minimum (16) and the grid's parallelism comes from active experts x N tiles; N is tiled finely
enough that those programs cover the SMs. bk is in *k values* (the packed MXFP4 tile is [bn, bk/2] bytes).

Invariants of a MoeBlock for (N, K): bm, bn powers of two >= 16; bk a power of two dividing K with bk >= 32
(>= 64 for MXFP4: 32 bytes, one scale per 16 of them, dots of K >= 16 on each nibble plane); bn | N.
Heuristics, to be tuned on the H200 (bench/kernels/moe.py --sweep).
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.gemm.block_sizes import pow2_divisor


@dataclass(frozen=True)
class MoeBlock:
    bm: int
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3


def pick_moe_block(M: int, N: int, K: int, *, fp4: bool, active: int | None = None, bn: int | None = None,
                   bk: int | None = None, num_warps: int = 4, num_stages: int = 3) -> MoeBlock:
    """M: rows (token-expert assignments); active: expected active experts (default min(M, 384)); bn / bk /
    num_warps / num_stages may be forced (bench sweeps)."""
    rows_per_expert = M / max(1, active or min(M, 384))
    bm = 16 if rows_per_expert <= 16 else (32 if rows_per_expert <= 32 else 64)
    bn = bn or pow2_divisor(N, 64 if bm <= 32 else 128)
    bk = bk or pow2_divisor(K, 256 if fp4 else 128, 64 if fp4 else 32)
    return MoeBlock(bm, bn, bk, num_warps, num_stages)
