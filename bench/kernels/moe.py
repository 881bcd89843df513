"""Microbenchmark cases of the active-experts grouped GEMM at V4.1 MoE shapes (384 experts, top-6).

`cases(smoke=False)` -> list of dicts: name, fn_pallas, fn_xla (jitted, on the args), make_args (zero-arg: random
full-shape device arrays, fixed seed), bytes (minimum bytes moved: the active experts' weights (+ scales), x, y).
Cases: w1/w3 (N=2304, K=5120) and w2 (N=5120, K=2304) of one layer, M = 6 * B rows for B in {1, 8, 32} tokens
routed uniformly at random (6 distinct experts each), bf16 and MXFP4. fn_xla is today's model path: dequantize
all 384 experts, then `lax.ragged_dot_general` (which reads every expert).

`python -m bench.kernels.moe [--iters N] [--only SUBSTR] [--sweep] [--out results.json] [--smoke]`: as
bench/kernels/gemm.py (same runner and table, bench/kernels/timing.py). --smoke: 8 experts of 256x512 at
B = 2 (CPU check).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.kernels.timing import run
from pallas_kernels.moe.block_sizes import pick_moe_block
from pallas_kernels.moe.kernel import grouped_matmul

E, TOPK = 384, 6
SHAPES = {"w13": (2304, 5120), "w2": (5120, 2304)}
BS = (1, 8, 32)
SMOKE_E, SMOKE_SHAPES, SMOKE_BS = 8, {"w_small": (256, 512)}, (2,)  # --smoke: interpret mode on the CPU
SWEEP = [(32, 256, 4, 3), (64, 256, 4, 3), (64, 512, 4, 3), (128, 256, 8, 3), (32, 512, 4, 4), (64, 128, 4, 4),
         (128, 512, 8, 3), (64, 512, 8, 4)]  # (bn, bk, num_warps, num_stages)


def group_sizes(B: int, seed: int = 0, n_exp: int = E) -> np.ndarray:
    """Uniform routing: each of B tokens picks TOPK distinct experts of n_exp."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(n_exp)[:TOPK] for _ in range(B)])
    return np.bincount(idx.reshape(-1), minlength=n_exp).astype(np.int32)


def _make_args(B, N, K, fp4: bool, seed: int = 0, n_exp: int = E):
    M = TOPK * B
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
    if fp4:
        w = jax.random.randint(k[1], (n_exp, N, K // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        s = jax.random.randint(k[2], (n_exp, N, K // 32), 118, 124, jnp.int32).astype(jnp.uint8)
        s = jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)
    else:
        w, s = (jax.random.normal(k[1], (n_exp, N, K), jnp.bfloat16) * 0.02).astype(jnp.bfloat16), None
    return jax.block_until_ready((x, w, jnp.asarray(group_sizes(B, seed, n_exp)), s))


def _bytes(B, N, K, fp4: bool, n_exp: int = E) -> int:
    active = int((group_sizes(B, 0, n_exp) > 0).sum())
    per_expert = N * K // 2 + N * K // 32 if fp4 else N * K * 2
    M = TOPK * B
    return active * per_expert + M * K * 2 + M * N * 4 + n_exp * 4


def _fn(implementation, block=None):
    return jax.jit(lambda x, w, g, s: grouped_matmul(x, w, g, scale=s, implementation=implementation, block=block))


def cases(smoke: bool = False) -> list[dict]:
    n_exp = SMOKE_E if smoke else E
    out = []
    for fp4 in (False, True):
        for wname, (N, K) in (SMOKE_SHAPES if smoke else SHAPES).items():
            for B in (SMOKE_BS if smoke else BS):
                out.append({"name": f"moe_{wname}_{'mxfp4' if fp4 else 'bf16'}_B{B}", "fn_pallas": _fn("pallas"),
                            "fn_xla": _fn("xla"), "make_args": functools.partial(_make_args, B, N, K, fp4, 0, n_exp),
                            "bytes": _bytes(B, N, K, fp4, n_exp), "shape": (TOPK * B, N, K), "fp4": fp4,
                            "experts": n_exp})
    return out


def sweep_fns(case):
    M, N, K = case["shape"]
    for bn, bk, warps, stages in SWEEP:
        if N % bn or K % bk:
            continue
        blk = pick_moe_block(M, N, K, fp4=case["fp4"], active=min(M, case["experts"]), bn=bn, bk=bk, num_warps=warps,
                             num_stages=stages)
        yield str(blk), _fn("pallas", blk)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    run(cases, argv, "bench.kernels.moe", sweep_fns)


if __name__ == "__main__":
    main()
