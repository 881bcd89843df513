"""Tile choice for the active-experts grouped GEMMs (pallas_kernels.moe.kernel: grouped_matmul, grouped_swiglu).

A program computes one (row tile of one active expert) x (N tile) x (K split). At decode an expert holds a few
rows, so bm is the dot minimum (16) and the grid's parallelism comes from active experts x N tiles x K splits;
N is tiled and K split finely enough that those programs cover the SMs. bk is in *k values* (the packed MXFP4
tile is [bn, bk/2] bytes); for MXFP4 it is also the unit of the decoded planes' k order (fp_decode), so a
`tiled` weight must have been laid out for this bk (checkpoints/kernel_layout.py).

Invariants of a MoeBlock for (N, K): bm, bn powers of two >= 16; bk a power of two, bk * splits | K, bk >= 64 for
MXFP4 (>= 128 tiled); bn | N; decode "bf16x2" (fp_decode) or "e4m3" (the first decoder, official layout only).
decode "fp8" (fp8_kernel.py, official layout, x as FP8 codes): bm = R rows per work item (any power of two), nb
blocks per dot with R * nb in (16, 32, 64), 32 * nb | bk (pallas_kernels/fp8dot.py).
(A swapped bf16 dot, weight tile as the M operand, gave wrong results compiled on the H200 with jax 0.11.2 /
Triton 3.6 while passing in interpret mode; it is not offered. The FP8-dot kernels' `swap` writes the transposed
output tile into an [N, M] buffer instead of transposing in the kernel.)
Measured on the H200 (bench/weight_gemms.py, bench/results/weight_gemms_h200.json, NOTES.md beside this file): at M
= 6 rows the defaults below were the fastest of the swept blocks for w1 (bm 16, bn 64, bk 256, 4 warps, 3 stages, 2
K splits: 33.3 us), w2 (bn 64, bk 256, no split: 29.2 and 28.9 us, the same block timed twice) and the fused w1/w3
(bn 64, bk 256, no split: 53.4 us); bn 16 or 32, bk 128 or 512, 8 warps and 4-5 stages were all slower. Other M use
the same rules (not swept).
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.gemm.block_sizes import NUM_SMS, fp8_rows, pow2_divisor

LAYOUTS = ("official", "tiled")
DECODES = ("bf16x2", "e4m3", "fp8")
MXFP4_LAYOUT = "official"  # the byte layout the default blocks read (checkpoints/kernel_layout.py converts to it)
TILED_BK = 256  # the k tile a "tiled" MXFP4 weight is laid out for (blocks reading it use this bk)
# The fused w1/w3 FP8-dot kernel's weight schedule (MoeBlock.w13): "joint" = both weights' tiles decoded and dotted
# in one k loop (the two decoded planes of both weights live at once: 211 registers a thread under ncu); "serial" =
# one program, w1's k loop then w3's (one weight's planes live at a time); "grid" = one weight per program (grid
# axis 2 = 2 x splits: f32 g / u partials, the SwiGLU in the wrapper as with K splits).
W13_MODES = ("joint", "serial", "grid")


@dataclass(frozen=True)
class MoeBlock:
    bm: int
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3
    splits: int = 1
    layout: str = "official"
    decode: str = "bf16x2"
    nb: int = 0  # decode "fp8": k blocks of 32 per dot (bm * nb = the MMA's rows)
    swap: bool = False  # decode "fp8": weight planes as the dots' first operand
    fast_accum: bool = False  # decode "fp8": FP8 wgmma accumulation inside a dot (pallas_kernels/fp8dot.py)
    prefetch: bool = False  # decode "fp8": a step's x tiles and scales loaded one step ahead (fp8_kernel.py)
    w13: str = "joint"  # decode "fp8", grouped_swiglu: how a program streams w1 / w3 (W13_MODES, fp8_kernel.py)


# (kernel, N, K, M) -> the fastest block measured at M rows routed over 384 experts (bench/weight_gemms.py prints
# these lines); kernel "gmm" (grouped_matmul) or "swiglu" (grouped_swiglu). A problem uses the entry of its (kernel,
# N, K) with the smallest tuned M >= its M; an FP8-dot entry only when x comes as FP8 codes, its R resized to the
# expected rows per active expert.
# Measured on the H200 (bench/results/weight_gemms_fp8dot_h200.json): w1/w3 + SwiGLU up to 192 rows; w2 and
# 1536 rows: the current kernel won (no entry). prefetch at 6 rows: 41.5 -> 38.7 us under Nsight Compute on an H100
# (bench/results/weight_gemm_counters_sweep_swiglu6_h100.json). `bench/weight_gemms.py --ab` on an H100 (no H200 could
# be started; bench/results/weight_gemms_ab_h100.json): prefetch at 48 / 192 rows 360 -> 259 us and 1121 -> 836 us
# (now on), at 6 rows 48.7 -> 46.3 us. w13="grid" at 1 row and grid with one split at 6 rows: 18.8 -> 17.7 us and
# 46.3 -> 43.7 us, and again on a second H100 the next day (bench/results/weight_gemms_ab2_h100.json): 18.5 -> 17.5
# and 46.1 -> 43.9 us; adopted (two runs, both on H100s).
TUNED: dict[tuple[str, int, int, int], MoeBlock] = {
    ("swiglu", 2304, 5120, 1): MoeBlock(bm=1, bn=64, bk=512, num_warps=4, num_stages=4, splits=5, layout="official",
                                        decode="fp8", nb=16, swap=True, fast_accum=True, w13="grid"),
    ("swiglu", 2304, 5120, 6): MoeBlock(bm=1, bn=64, bk=512, num_warps=4, num_stages=3, splits=1, layout="official",
                                        decode="fp8", nb=16, swap=True, fast_accum=True, prefetch=True, w13="grid"),
    ("swiglu", 2304, 5120, 48): MoeBlock(bm=2, bn=64, bk=512, num_warps=4, num_stages=3, splits=1, layout="official",
                                         decode="fp8", nb=8, swap=True, fast_accum=True, prefetch=True),
    ("swiglu", 2304, 5120, 192): MoeBlock(bm=2, bn=64, bk=512, num_warps=4, num_stages=3, splits=1, layout="official",
                                          decode="fp8", nb=8, swap=True, fast_accum=True, prefetch=True),
}

def _splits(programs: int, ksteps: int, target: int) -> int:
    """Smallest power-of-two K split (dividing ksteps) that brings the programs to `target`."""
    s = 1
    while programs * s < target and ksteps % (2 * s) == 0 and ksteps // (2 * s) >= 2:
        s *= 2
    return s


def tuned_moe_block(M: int, N: int, K: int, active: int, fused: bool, x_fp8: bool,
                    layout: str = MXFP4_LAYOUT) -> MoeBlock | None:
    kind = "swiglu" if fused else "gmm"
    keys = sorted(m for (k, n, kk, m), b in TUNED.items() if (k, n, kk) == (kind, N, K) and m >= M
                  and (x_fp8 or b.decode != "fp8") and b.layout == layout)
    if not keys:
        return None
    blk = TUNED[(kind, N, K, keys[0])]
    if blk.decode == "fp8":
        blk = fp8_rows(blk, -(-M // max(1, active)), K)
        if blk is None or blk.bm > 16:
            return None
    return blk


def pick_moe_block(M: int, N: int, K: int, *, fp4: bool, active: int | None = None, bn: int | None = None,
                   bk: int | None = None, num_warps: int = 4, num_stages: int = 3, fused: bool = False,
                   layout: str = MXFP4_LAYOUT, x_fp8: bool = False) -> MoeBlock:
    """M: rows (token-expert assignments); active: expected active experts (default min(M, 384)); bn / bk /
    num_warps / num_stages may be forced (bench sweeps); fused: the w1/w3 kernel (two weight streams); x_fp8: x
    comes as FP8 codes (FP8-dot blocks qualify). The tuned block of (kernel, N, K, M) if any, else heuristics."""
    active = active or min(M, 384)
    if fp4 and bn is None and bk is None:
        blk = tuned_moe_block(M, N, K, active, fused, x_fp8, layout)
        if blk is not None:
            return blk
    rows_per_expert = M / max(1, active)
    bm = 16 if rows_per_expert <= 16 else (32 if rows_per_expert <= 32 else 64)
    bn = bn or pow2_divisor(N, 64 if bm <= 32 else 128)
    bk = bk or (TILED_BK if layout == "tiled" else pow2_divisor(K, 256 if fp4 else 128, 64 if fp4 else 32))
    splits = 1
    if fp4 and not fused:
        splits = _splits(active * (N // bn), K // bk, 2 * NUM_SMS)
    return MoeBlock(bm, bn, bk, num_warps, num_stages, splits, layout)
