"""Tile choice for the small-M GEMM (pallas_kernels.gemm.kernel.matmul).

Decode GEMMs (M <= 64) are bound by reading the weight once: the grid must hold enough programs to keep every
SM streaming (>= TARGET_PROGRAMS), each reading contiguous [bn, bk] weight tiles. When N alone gives too few
tiles, K is split into `splits` contiguous ranges whose f32 partial sums the wrapper adds (a tiny [S, M, N]
reduction). Large M (prefill) uses larger M tiles and no split.

Invariants of a GemmBlock for a problem (M, N, K): bm, bn, bk are powers of two >= 16 (Triton load shapes and
`plt.dot` dims), bn | N, bk | K, splits | K / bk, and bn, bk multiples of 32 for FP8 (one scale per 32x32 tile).
decode "fp8" (FP8 x FP8 dot, fp8_kernel.py; x must come as E4M3 codes + block scales): bm = R rows per M tile
(any power of two), nb = k blocks per dot with R * nb in (16, 32, 64), 32 * nb | bk (pallas_kernels/fp8dot.py).
The heuristics below were measured at the full model's FP8 shapes, M = 1, 8, 64 (bench/results/
weight_gemms_h200.json, pallas_kernels/moe/NOTES.md). `TUNED` holds the winners of the block sweep of
bench/weight_gemms.py per (N, K, M) (the bench prints the lines to paste); a problem uses the entry of its (N, K)
with the smallest tuned M >= its M, an FP8-dot entry only when x comes as FP8 codes, with R resized to M.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

NUM_SMS = 132  # H200
DECODES = ("bf16x2", "convert", "fp8")  # FP8 weight paths: bf16 decoders (kernel.py), FP8 x FP8 dot (fp8_kernel.py)
TARGET_PROGRAMS = 2 * NUM_SMS
FP8_LAYOUT = "official"  # the FP8 linears' byte layout the kernels read (checkpoints/kernel_layout.py)


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
    nb: int = 0  # decode "fp8": k blocks of 32 per dot (bm * nb = the MMA's rows)
    fast_accum: bool = False  # decode "fp8": FP8 wgmma accumulation inside a dot (pallas_kernels/fp8dot.py)
    prefetch: bool = False  # decode "fp8": a step's x tiles and scales loaded one step ahead (fp8_kernel.py)


# (N, K, M) -> the fastest block measured for that FP8 weight shape at M rows (bench/weight_gemms.py).
# Measured on the H200 (bench/results/weight_gemms_fp8dot_h200.json); shapes and rows where the current kernel won
# have no entry (the heuristics below).
TUNED: dict[tuple[int, int, int], GemmBlock] = {
    (2304, 5120, 1): GemmBlock(bm=1, bn=64, bk=512, splits=5, num_warps=4, num_stages=3, decode="fp8", swap=True, nb=16,
                               fast_accum=True),
    (5120, 2304, 1): GemmBlock(bm=2, bn=64, bk=256, splits=3, num_warps=4, num_stages=3, decode="fp8", swap=False, nb=8,
                               fast_accum=False),
    (5120, 8192, 1): GemmBlock(bm=1, bn=64, bk=512, splits=4, num_warps=4, num_stages=3, decode="fp8", swap=True, nb=16,
                               fast_accum=True),
    (1280, 5120, 1): GemmBlock(bm=1, bn=64, bk=512, splits=5, num_warps=4, num_stages=3, decode="fp8", swap=True, nb=16,
                               fast_accum=True),
    (32768, 1280, 1): GemmBlock(bm=2, bn=64, bk=256, splits=1, num_warps=4, num_stages=3, decode="fp8", swap=False,
                                nb=8, fast_accum=False),
    (32768, 1280, 8): GemmBlock(bm=8, bn=64, bk=256, splits=1, num_warps=4, num_stages=3, decode="fp8", swap=False,
                                nb=2, fast_accum=False),
    (32768, 1280, 64): GemmBlock(bm=64, bn=64, bk=256, splits=1, num_warps=4, num_stages=3, decode="fp8", swap=False,
                                 nb=1, fast_accum=True),
}


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


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def fp8_rows(blk, rows: int, K: int):
    """An FP8-dot block resized to R >= rows rows per tile, keeping its MMA row count where it can (R * nb in
    (16, 32, 64), 32 * nb | K, bk and splits still tiling K); None where that is impossible (rows > 64)."""
    R = next_pow2(rows)
    if R > 64:
        return None
    mma = max(blk.bm * blk.nb, 16 if R <= 16 else R)
    nb = max(1, mma // R)
    while nb > 1 and K % (32 * nb):
        nb //= 2
    R = mma // nb
    bk = max(blk.bk, 32 * nb)
    while bk > 32 * nb and K % (bk * blk.splits):
        bk //= 2
    splits = blk.splits if K % (bk * blk.splits) == 0 else 1
    return None if K % bk else replace(blk, bm=R, nb=nb, bk=bk, splits=splits)


def tuned_gemm_block(M: int, N: int, K: int, x_fp8: bool) -> GemmBlock | None:
    keys = sorted(m for (n, k, m), b in TUNED.items() if (n, k) == (N, K) and m >= M and (x_fp8 or b.decode != "fp8"))
    if not keys:
        return None
    blk = TUNED[(N, K, keys[0])]
    return fp8_rows(blk, M, K) if blk.decode == "fp8" else blk


def pick_gemm_block(M: int, N: int, K: int, *, fp8: bool, bn: int | None = None, bk: int | None = None,
                    num_warps: int | None = None, num_stages: int = 3, x_fp8: bool = False) -> GemmBlock:
    """The tuned block of (N, K, M) if any (x_fp8: x comes as FP8 codes, so FP8-dot blocks qualify), else
    heuristic tiles; bn / bk / num_warps / num_stages may be forced (bench sweeps), the split then follows."""
    if fp8 and bn is None and bk is None and num_warps is None:
        blk = tuned_gemm_block(M, N, K, x_fp8)
        if blk is not None:
            return blk
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
