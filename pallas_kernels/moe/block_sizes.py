"""Tile choice for the active-experts grouped GEMMs (pallas_kernels.moe.kernel: grouped_matmul, grouped_swiglu).

A program computes one (row tile of one active expert) x (N tile) x (K split). At decode an expert holds a few
rows, so bm is the dot minimum (16) and the grid's parallelism comes from active experts x N tiles x K splits;
N is tiled and K split finely enough that those programs cover the SMs. bk is in *k values* (the packed MXFP4
tile is [bn, bk/2] bytes); for MXFP4 it is also the unit of the decoded planes' k order (fp_decode), so a
`tiled` weight must have been laid out for this bk (checkpoints/kernel_layout.py).

Invariants of a MoeBlock for (N, K): bm, bn powers of two >= 16; bk a power of two, bk * splits | K, bk >= 64 for
MXFP4 (>= 128 tiled); bn | N; decode "bf16x2" (fp_decode) or "e4m3" (the first decoder, official layout only).
(A swapped dot, weight tile as the M operand, gave wrong results compiled on the H200 with jax 0.11.2 /
Triton 3.6 while passing in interpret mode; it is not offered.)
Measured on the H200 (bench/weight_gemms.py, bench/results/weight_gemms_h200.json, NOTES.md beside this file): at M
= 6 rows the defaults below were the fastest of the swept blocks for w1 (bm 16, bn 64, bk 256, 4 warps, 3 stages, 2
K splits: 33.3 us), w2 (bn 64, bk 256, no split: 29.2 and 28.9 us, the same block timed twice) and the fused w1/w3
(bn 64, bk 256, no split: 53.4 us); bn 16 or 32, bk 128 or 512, 8 warps and 4-5 stages were all slower. Other M use
the same rules (not swept).
"""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.gemm.block_sizes import NUM_SMS, pow2_divisor

LAYOUTS = ("official", "tiled")
DECODES = ("bf16x2", "e4m3")


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


def _splits(programs: int, ksteps: int, target: int) -> int:
    """Smallest power-of-two K split (dividing ksteps) that brings the programs to `target`."""
    s = 1
    while programs * s < target and ksteps % (2 * s) == 0 and ksteps // (2 * s) >= 2:
        s *= 2
    return s


def pick_moe_block(M: int, N: int, K: int, *, fp4: bool, active: int | None = None, bn: int | None = None,
                   bk: int | None = None, num_warps: int = 4, num_stages: int = 3, fused: bool = False,
                   layout: str = "official") -> MoeBlock:
    """M: rows (token-expert assignments); active: expected active experts (default min(M, 384)); bn / bk /
    num_warps / num_stages may be forced (bench sweeps); fused: the w1/w3 kernel (two weight streams)."""
    active = active or min(M, 384)
    rows_per_expert = M / max(1, active)
    bm = 16 if rows_per_expert <= 16 else (32 if rows_per_expert <= 32 else 64)
    bn = bn or pow2_divisor(N, 64 if bm <= 32 else 128)
    bk = bk or pow2_divisor(K, 256 if fp4 else 128, 64 if fp4 else 32)
    splits = 1
    if fp4 and not fused:
        splits = _splits(active * (N // bn), K // bk, 2 * NUM_SMS)
    return MoeBlock(bm, bn, bk, num_warps, num_stages, splits, layout)
