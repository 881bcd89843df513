"""Tile choice of the paged indexer kernel: how many index-key entries one program scores.

One program scores `entries` consecutive output columns (entries / block_size whole blocks) for one query
row. Larger tiles amortise the per-program query load (Hi x di bf16 = 8 KiB at full shape) and give the
tensor-core dot a larger M; smaller tiles spread a batch-1 decode over more SMs. Rule: the largest tile in
(128, 64, 32) that still launches at least `MIN_PROGRAMS` programs (two waves over the H200's 132 SMs).
All tiles are powers of two (Pallas Triton load shapes) and multiples of the 8-entry candidate block.
Not tuned on the GPU yet: the lead's bench (bench/kernels/indexer.py) is where to tune it.
"""

from __future__ import annotations

H200_SMS = 132
MIN_PROGRAMS = 2 * H200_SMS
TILES = (128, 64, 32)


def entries_per_program(rows: int, n_columns: int, block_size: int = 8) -> int:
    """rows = B * T query rows; n_columns = nb * block_size scored entries per row."""
    for e in TILES:
        if e % block_size:
            continue
        if rows * -(-n_columns // e) >= MIN_PROGRAMS:
            return e
    return TILES[-1] if TILES[-1] % block_size == 0 else block_size
