"""Microbenchmark cases of the mHC-coefficient kernel: one call per sublayer, rows = batch (decode) or chunk
tokens (prefill). The XLA side is the model's one jnp reference, dsv41_jax.layers.hc_coefficients (the Sinkhorn
loop as a fori loop).

`cases(smoke=False)` -> list of dicts: name, fn_pallas, fn_xla, make_args, bytes (rows N = 1, 32, 2048; smoke:
N = 5, a partial row block, for a CPU run in interpret mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax import layers
from pallas_kernels.mhc.kernel import hc_coefficients

HC, ITERS, EPS = 4, 20, 1e-6


def _make_args(n, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    m = jax.random.normal(k1, (n, (2 + HC) * HC), jnp.float32) * 2
    scale = jax.random.uniform(k2, (3,), jnp.float32, 0.5, 1.0)
    base = jax.random.normal(k3, ((2 + HC) * HC,), jnp.float32) * 0.5
    return m, scale, base


def cases(smoke: bool = False) -> list[dict]:
    fp = jax.jit(functools.partial(hc_coefficients, hc=HC, iters=ITERS, eps=EPS))
    fx = jax.jit(functools.partial(layers.hc_coefficients, hc=HC, iters=ITERS, eps=EPS))
    return [{"name": f"hc_coefficients_N{n}", "fn_pallas": fp, "fn_xla": fx,
             "make_args": functools.partial(_make_args, n), "bytes": n * (24 + 24) * 4}
            for n in ((5,) if smoke else (1, 32, 2048))]
