"""Kernel microbenchmarks: every Pallas kernel beside its XLA reference at the full model's shapes (GPU).

One module per kernel (gemm, moe, indexer, sparse_attention, mhc), each with `cases()` and its own CLI
(`python -m bench.kernels.gemm ...`); `timing.py` holds the timers and the per-kernel runner; `all.py` times
every kernel's cases in one table (`python -m bench.kernels`, the same as `python -m bench.kernels.all`).
"""
