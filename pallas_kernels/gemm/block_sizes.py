"""Tile choice for the small-M GEMM (pallas_kernels.gemm.kernel.matmul).

Decode GEMMs (M <= 64) are bound by reading the weight once: the grid must hold enough programs to keep every
SM streaming (>= TARGET_PROGRAMS), each reading contiguous [bn, bk] weight tiles. When N alone gives too few
tiles, K is split into `splits` contiguous ranges whose f32 partial sums the wrapper adds (a tiny [S, M, N]
reduction). Large M (prefill) uses larger M tiles and no split.

Invariants of a GemmBlock for a problem (M, N, K): bm, bn, bk are powers of two >= 16 (Triton load shapes and
`plt.dot` dims), bn | N, bk | K, splits | K / bk, and bn, bk multiples of 32 for FP8 (one scale per 32x32 tile).
These numbers are heuristics: the H200 run of bench/weight_gemms.py (bench/results/weight_gemms_h200.json,
pallas_kernels/moe/NOTES.md) measured them at the full model's FP8 shapes, M = 1, 8, 64, without a block sweep.
"""

from __future__ import annotations

from dataclasses import dataclass

NUM_SMS = 132  # H200
DECODES = ("bf16x2", "convert")  # FP8 decoders (kernel.py)
TARGET_PROGRAMS = 2 * NUM_SMS


@dataclass(frozen=True)
class GemmBlock:
    bm: int
    bn: int
    bk: int
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3
    decode: str = "bf16x2"
    swap: bool = False


def pow2_divisor(n: int, cap: int, floor: int = 16) -> int:
    """Largest power of two <= cap dividing n (>= floor), or raise."""
    b = cap
    while b >= floor:
        if n % b == 0:
            return b
        b //= 2
    raise ValueError(f"{n} has no power-of-two divisor in [{floor}, {cap}]")


def m_tile(M: int) -> int:
    """M tile: the next power of two of M (>= 16, the dot minimum) up to 64; 128 for long prefills."""
    if M >= 1024:
        return 128
    b = 16
    while b < min(M, 64):
        b *= 2
    return b


def pick_gemm_block(M: int, N: int, K: int, *, fp8: bool, bn: int | None = None, bk: int | None = None,
                    num_warps: int | None = None, num_stages: int = 3) -> GemmBlock:
    """Heuristic tiles; bn / bk / num_warps / num_stages may be forced (bench sweeps), the split then follows."""
    bm = m_tile(M)
    m_tiles = -(-M // bm)
    bk = bk or pow2_divisor(K, 256 if M <= 64 else 64, 32 if fp8 else 16)
    bn = bn or pow2_divisor(N, 64 if M <= 64 else 128, 32 if fp8 else 16)
    steps = K // bk
    splits = 1
    if M <= 64:
        for d in range(1, steps + 1):
            if steps % d == 0:
                splits = d
                if m_tiles * (N // bn) * d >= TARGET_PROGRAMS:
                    break
    warps = num_warps or (4 if bm * bn <= 64 * 64 else 8)
    return GemmBlock(bm, bn, bk, splits, warps, num_stages)
