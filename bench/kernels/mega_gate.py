"""Microbenchmark cases of the Mega-Gate kernel (the MoE router in one launch). The XLA side is the model's
router, dsv41_jax.layers.gate, jitted on the same stacked gate weights sliced in the program as the model does.

`cases(smoke=False)` -> list of dicts: name, fn_pallas, fn_xla, make_args, bytes (rows N = 1, 8, 32, 256 at the
full model's D = 5120, E = 384 experts, top-6, weights stacked over 40 layers; smoke: D = 256, E = 48, N = 5).
`variants()` adds the medium preset's 16 experts for bench/fused_kernels.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax import layers
from dsv41_jax.config import ModelConfig
from pallas_kernels.mega_gate import route

FULL_D, FULL_L, K = 5120, 40, 6
NS = (1, 8, 32, 256)


def _cfg(e):
    return ModelConfig.preset("tiny").replace(n_routed_experts=e, n_activated_experts=K, route_scale=1.5)


def make_args(n, d, e, n_layers, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (n, d), jnp.bfloat16)
    w = (jax.random.normal(k[1], (n_layers, e, d), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
    b = jax.random.normal(k[2], (n_layers, e), jnp.float32) * 0.1
    return x, w, b, jnp.int32(n_layers // 2)


def fused(e):
    cfg = _cfg(e)

    def f(x, w, b, layer):
        return route(x, w, b, k=K, route_scale=cfg.route_scale, norm_topk_prob=cfg.norm_topk_prob, layer=layer)

    return jax.jit(f)


def reference(e):
    cfg = _cfg(e)

    def f(x, w, b, layer):
        p = {"weight": jax.lax.dynamic_index_in_dim(w, layer, keepdims=False),
             "bias": jax.lax.dynamic_index_in_dim(b, layer, keepdims=False)}
        return layers.gate(cfg, p, x)

    return jax.jit(f)


def nbytes(n, d, e):
    return e * d * 2 + e * 4 + n * (d * 2 + K * 8)


def cases(smoke: bool = False) -> list[dict]:
    d, e, n_layers, ns = (256, 48, 2, (5,)) if smoke else (FULL_D, 384, FULL_L, NS)
    return [{"name": f"mega_gate_E{e}_N{n}", "fn_pallas": fused(e), "fn_xla": reference(e),
             "make_args": functools.partial(make_args, n, d, e, n_layers), "bytes": nbytes(n, d, e)} for n in ns]


def variants(smoke: bool = False) -> list[dict]:
    """The full model's 384 experts at every N first; the medium preset's 16 at N = 1, 8 last (priority 1)."""
    d, n_layers = (256, 2) if smoke else (FULL_D, FULL_L)
    grid = [(48, 5, 0)] if smoke else [(384, n, 0) for n in NS] + [(16, n, 1) for n in (1, 8)]
    return [{"op": f"mega_gate_E{e}", "n": n, "make_args": functools.partial(make_args, n, d, e, n_layers),
             "bytes": nbytes(n, d, e), "reference": reference(e), "fused": {"fused": fused(e)},
             "unfused": {"xla": reference(e)}, "n_layers": n_layers, "priority": prio} for e, n, prio in grid]
