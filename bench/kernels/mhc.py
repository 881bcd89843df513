"""Microbenchmark cases of the mHC-coefficient kernel: one call per sublayer, rows = batch (decode) or chunk
tokens (prefill). The XLA reference runs the Sinkhorn loop as a while loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mhc.kernel import hc_coefficients

HC, ITERS, EPS = 4, 20, 1e-6


def _make_args(n, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    m = jax.random.normal(k1, (n, (2 + HC) * HC), jnp.float32) * 2
    scale = jax.random.uniform(k2, (3,), jnp.float32, 0.5, 1.0)
    base = jax.random.normal(k3, ((2 + HC) * HC,), jnp.float32) * 0.5
    return m, scale, base


def _fn(implementation):
    return jax.jit(functools.partial(hc_coefficients, hc=HC, iters=ITERS, eps=EPS, implementation=implementation))


def cases() -> list[dict]:
    out = []
    for n in (1, 32, 2048):
        out.append({"name": f"hc_coefficients_N{n}", "fn_pallas": _fn("pallas"), "fn_xla": _fn("xla"),
                    "make_args": functools.partial(_make_args, n), "bytes": n * (24 + 24) * 4})
    return out
