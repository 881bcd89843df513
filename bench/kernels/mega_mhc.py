"""Microbenchmark cases of the Mega-mHC kernel (one sublayer boundary: hc-post, mixes + Sinkhorn, hc-pre,
RMSNorm, FP8 quantisation). The XLA side is the model's unfused path: dsv41_jax.layers.hc_boundary plus the FP8
quantisation the next linear applies (quant.fp8_qdq), jitted, on the same stacked weights sliced in the program
as the model slices them.

`cases(smoke=False)` -> list of dicts: name, fn_pallas, fn_xla, make_args, bytes (rows N = 1, 8, 32, 256 at the
full model's D = 5120, weights stacked over 40 layers; smoke: D = 256, N = 5, for a CPU run in interpret mode).
`variants()` adds the two-launch form and the previous Pallas composition (XLA hc-post / hc-pre / norm / qdq around
the Sinkhorn kernel, pallas_kernels/mhc) for bench/fused_kernels.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsv41_jax import layers, quant
from pallas_kernels.mega_mhc import hc_boundary, pick_blocks
from pallas_kernels.mhc import hc_coefficients

HC, MW, ITERS, EPS, NORM_EPS = 4, 24, 20, 1e-6, 1e-20
FULL_D, FULL_L = 5120, 40
NS = (1, 8, 32, 256)


class _Cfg:  # the fields the reference reads (the full preset's values)
    hc_mult, hc_sinkhorn_iters, hc_eps, norm_eps = HC, ITERS, EPS, NORM_EPS


def make_args(n, d, n_layers, seed=0):
    k = jax.random.split(jax.random.key(seed), 8)
    y = jax.random.normal(k[0], (n, d), jnp.bfloat16)
    h = jax.random.normal(k[1], (n, HC, d), jnp.bfloat16)
    pre = jax.random.uniform(k[2], (n, HC), jnp.float32, 0.1, 1.0)
    post = jax.random.uniform(k[3], (n, HC), jnp.float32, 0.0, 2.0)
    comb = jax.nn.softmax(jax.random.normal(k[4], (n, HC, HC), jnp.float32), axis=-1)
    mix = layers.hc_pack(pre, post, comb)
    fn = jax.random.normal(k[5], (n_layers, MW, HC * d), jnp.float32) * (HC * d) ** -0.5
    scale = jax.random.uniform(k[6], (n_layers, 3), jnp.float32, 0.5, 1.0)
    base = jax.random.normal(k[7], (n_layers, MW), jnp.float32) * 0.5
    norm = (1.0 + 0.1 * jax.random.normal(k[0], (n_layers, d), jnp.float32)).astype(jnp.bfloat16)
    layer = jnp.int32(n_layers // 2)
    return y, h, mix, fn, scale, base, norm, layer


def fused(single_launch: bool = True, num_warps: int | None = None):
    """The kernel with pick_blocks' blocks; num_warps overrides their warps (a side-by-side variant)."""
    def f(y, h, mix, fn, scale, base, norm, layer):
        b = pick_blocks(y.shape[0], y.shape[1])
        b = b if num_warps is None else dataclasses.replace(b, num_warps=num_warps)
        return hc_boundary(y, h, mix, fn, scale, base, norm, layer=layer, hc=HC, iters=ITERS, eps=EPS,
                           norm_eps=NORM_EPS, quantize=True, single_launch=single_launch, blocks=b)

    return jax.jit(f)


def _slice(a, layer):
    return jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)


@jax.jit
def reference(y, h, mix, fn, scale, base, norm, layer):
    """The unfused XLA path (--kernels xla): the reference, then the next linear's input quantisation."""
    hn, x, mix_new = layers.hc_boundary(_Cfg, h, y, mix, *(_slice(a, layer) for a in (fn, scale, base, norm)))
    return hn, x, quant.fp8_qdq(x, 32), mix_new


@jax.jit
def previous(y, h, mix, fn, scale, base, norm, layer):
    """The composition --kernels pallas ran before Mega-mHC: XLA glue around the Sinkhorn kernel."""
    fn, scale, base, norm = (_slice(a, layer) for a in (fn, scale, base, norm))
    pre, post, comb = layers.hc_split(_Cfg, mix)
    hn = layers.hc_post(y, h, post, comb)
    m = layers.hc_logits(_Cfg, hn, fn)
    mix_new = layers.hc_pack(*hc_coefficients(m, scale, base, hc=HC, iters=ITERS, eps=EPS))
    x = layers.rms_norm(_Cfg, layers.hc_pre(hn, pre), norm)
    return hn, x, quant.fp8_qdq(x, 32), mix_new


def nbytes(n, d, hc=HC):
    """The fewest bytes a boundary moves: h read + written, y, x and xq written, one layer's fn (f32) and norm."""
    return n * (hc * d * 4 + d * 2 + d * 4 + MW * 8) + MW * hc * d * 4 + d * 2


def cases(smoke: bool = False) -> list[dict]:
    d, n_layers, ns = (256, 2, (5,)) if smoke else (FULL_D, FULL_L, NS)
    fp, fx = fused(True), reference
    return [{"name": f"mega_mhc_N{n}", "fn_pallas": fp, "fn_xla": fx,
             "make_args": functools.partial(make_args, n, d, n_layers), "bytes": nbytes(n, d)} for n in ns]


def variants(smoke: bool = False) -> list[dict]:
    """bench/fused_kernels.py: for each N, the fused kernel (one launch, two launches; pick_blocks' warps, and 4 warps
    side by side: the blocks before 8 warps, whose phase 1 spilled registers) and both unfused paths."""
    d, n_layers, ns = (256, 2, (5,)) if smoke else (FULL_D, FULL_L, NS)
    return [{"op": "mega_mhc", "n": n, "make_args": functools.partial(make_args, n, d, n_layers),
             "bytes": nbytes(n, d), "reference": reference,
             "fused": {"fused": fused(True), "fused_2launch": fused(False), "fused_w4": fused(True, 4)},
             "unfused": {"xla": reference, "prev_pallas": previous}, "n_layers": n_layers} for n in ns]
