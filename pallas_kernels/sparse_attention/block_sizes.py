"""Launch configuration of the paged sparse attention kernel: head block, KV split and Triton parameters.

A program handles one query row, `block_h` heads and a contiguous range of 64-key chunks of the row's key
list (window chunks first, then selected-entry chunks). With `num_splits` > 1 the chunk ranges of a row run in
parallel programs; the split that arrives last merges their (max, sum, numerator) partials in-kernel.

Trade-offs (H200, decode; from Triton 3.6 sm_90a compiles of the full shape, not yet timed): every program
decodes its keys, so a smaller head block repeats the FP4/FP8 decode H / block_h times, and below 64 heads
Triton uses mma.sync and recomputes the decode once more per dot layout; block_h = 64 uses wgmma with the
decoded keys staged once in shared memory (~2.6K SASS instructions per thread per 64-key chunk, vs ~3.3K
per 16-head block), at the price of a 64 x 512 f32 accumulator (some register spills). Splits fill the GPU
when there are few rows but write f32 partials of block_h x d per split, merged by XLA; `auto` keeps the
largest head block (<= 64) and adds splits while the programs still fit one wave (one CTA per SM: the kernel
uses ~144 KiB of shared memory at block_h = 64).
Measured on the H200 (jax 0.11.2, full shape, decode; bench/results/kernels_h200.json): the 64-head block
spills and loses: B=1 26.7 us (h64, auto splits) vs 14.6 us (h16, auto splits); B=32 78 us (h64, 4 splits) vs
59.7 us (h32, 2 splits). Default: block_h 16 below 8 rows, else 32; splits fill one wave.
Invariants: block_h is a power of two >= 16 (plt.dot needs M >= 16); 1 <= num_splits <= number of chunks;
num_stages stays 1 (2 stages double the shared memory past the 227 KiB limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SM_COUNT = 132  # H200


@dataclass(frozen=True)
class BlockSizes:
    block_h: int | None = None  # heads per program (power of two >= 16); None: 16 / 32 (see above)
    num_splits: int | None = None  # programs per row along the key list; None: auto
    num_warps: int = 8
    num_stages: int = 1
    target_programs: int = SM_COUNT  # auto: the most splits with rows * head blocks * splits <= this

    def resolve(self, rows: int, n_heads: int, n_chunks: int) -> ResolvedBlockSizes:
        bh = self.block_h or min(16 if rows < 8 else 32, max(16, 1 << max(0, math.ceil(math.log2(max(n_heads, 1))))))
        if bh < 16 or bh & (bh - 1):
            raise ValueError(f"block_h must be a power of two >= 16, got {bh}")
        h_pad = -(-n_heads // bh) * bh
        programs = rows * (h_pad // bh)
        if self.num_splits is None:
            splits = max(1, self.target_programs // programs)
        else:
            splits = self.num_splits
        splits = max(1, min(splits, n_chunks))
        per = -(-n_chunks // splits)
        splits = -(-n_chunks // per)  # no empty split
        return ResolvedBlockSizes(bh, h_pad, splits, per, self.num_warps, self.num_stages)


@dataclass(frozen=True)
class ResolvedBlockSizes:
    block_h: int
    heads_padded: int
    num_splits: int
    chunks_per_split: int
    num_warps: int
    num_stages: int
