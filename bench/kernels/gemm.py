"""Microbenchmark cases of the small-M GEMM at V4.1 decode shapes (timed by bench/kernels/timing.py).

`cases(smoke=False)` -> list of dicts: name, fn_pallas, fn_xla (jitted, on the args), make_args (zero-arg: random
full-shape device arrays, fixed seed), bytes (minimum bytes moved: one layer's weight (+ scales), x, y).
Cases: M in {1, 8, 32} x {wq_a 1280x5120, wq_b 32768x1280, wo_b 5120x8192, shared w1 2304x5120} x {bf16, FP8},
each weight stacked [L=4, N, K] with a layer index, so the XLA branch pays the per-layer slice the model pays.

`python -m bench.kernels.gemm [--iters N] [--only SUBSTR] [--sweep] [--out results.json] [--smoke]` times both on the
current device and prints a table last: wall_us = median wall time of synced calls (includes ~10-40 us of
dispatch), dev_us = device busy time per call from a profiler trace (union of the GPU's kernel/memcpy intervals
/ calls; "-" if the trace has no device plane), GB/s = bytes / dev_us (HBM peak 4.8 TB/s, copy ~4.3 TB/s), and
rel_err = max |pallas - xla| / max |xla|. --sweep instead times the Pallas kernel over a few tile configs per
case and prints the best ones (for block_sizes.py). --smoke: one 256x512 weight at M = 5 (CPU check).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from bench.kernels.timing import run
from pallas_kernels.gemm.block_sizes import pick_gemm_block
from pallas_kernels.gemm.kernel import matmul

L = 4
SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192), "shared_w1": (2304, 5120)}
MS = (1, 8, 32)
SMOKE_SHAPES, SMOKE_MS = {"w_small": (256, 512)}, (5,)  # --smoke: interpret mode on the CPU
SWEEP = [(32, 256, 4, 3), (64, 256, 4, 3), (64, 512, 4, 3), (128, 256, 8, 3), (64, 128, 4, 4), (128, 128, 4, 4),
         (32, 512, 4, 4), (64, 256, 8, 4)]  # (bn, bk, num_warps, num_stages)


# ----------------------------------------------------------------------------- cases
def _make_args(M, N, K, fp8: bool, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
    if fp8:
        w = jax.random.normal(k[1], (L, N, K), jnp.float32).astype(jnp.float8_e4m3fn)
        s = jax.random.randint(k[2], (L, N // 32, K // 32), 115, 125, jnp.int32).astype(jnp.uint8)
        s = jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)
    else:
        w, s = (jax.random.normal(k[1], (L, N, K), jnp.float32) * 0.02).astype(jnp.bfloat16), None
    return jax.block_until_ready((x, w, s, jnp.int32(2)))


def _bytes(M, N, K, fp8: bool) -> int:
    return N * K * (1 if fp8 else 2) + (N // 32) * (K // 32) * fp8 + M * K * 2 + M * N * 4


def _fn(implementation, block=None):
    return jax.jit(lambda x, w, s, l: matmul(x, w, scale=s, layer=l, implementation=implementation, block=block))


def cases(smoke: bool = False) -> list[dict]:
    out = []
    for fp8 in (False, True):
        for wname, (N, K) in (SMOKE_SHAPES if smoke else SHAPES).items():
            for M in (SMOKE_MS if smoke else MS):
                out.append({"name": f"gemm_{wname}_{'fp8' if fp8 else 'bf16'}_M{M}", "fn_pallas": _fn("pallas"),
                            "fn_xla": _fn("xla"), "make_args": functools.partial(_make_args, M, N, K, fp8),
                            "bytes": _bytes(M, N, K, fp8), "shape": (M, N, K), "fp8": fp8})
    return out


def sweep_fns(case):
    M, N, K = case["shape"]
    for bn, bk, warps, stages in SWEEP:
        if N % bn or K % bk:
            continue
        blk = pick_gemm_block(M, N, K, fp8=case["fp8"], bn=bn, bk=bk, num_warps=warps, num_stages=stages)
        yield str(blk), _fn("pallas", blk)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    run(cases, argv, "bench.kernels.gemm", sweep_fns)


if __name__ == "__main__":
    main()
