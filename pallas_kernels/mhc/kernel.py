"""mHC coefficients from the mixing logits, in one Pallas kernel (the model's side and the jnp reference this
kernel is tested against: dsv41_jax.layers.hc_coefficients).

Given m = (flatten(X) @ hc_fn^T) * rsqrt(mean(X^2) + eps) ([N, (2+hc)*hc] f32, the GEMM stays in XLA), compute
    pre  = sigmoid(m[0:hc] * s0 + base[0:hc]) + hc_eps
    post = 2 * sigmoid(m[hc:2hc] * s1 + base[hc:2hc])
    C    = row-softmax((m[2hc:] * s2 + base[2hc:]).reshape(hc, hc)) + hc_eps, then a column normalisation,
           then (iters - 1) x [row-normalise, column-normalise], each dividing by (sum + hc_eps).
The XLA version runs the Sinkhorn loop as a while loop: one or more kernel launches per iteration, ~40 per call
and ~1,600 per decode step of V4.1. Here a program holds a block of rows and does every iteration in
registers: one launch per call. With `layer`, scale and base are the layer stacks ([L, 3], [L, (2+hc)*hc]) and
the kernel reads row `layer` in place (no per-layer slice kernels before it).

Numerics: the same f32 operations in the same order (row sums and column sums added left to right); XLA may
order its 4-term reductions differently and lower exp/sigmoid with other instruction sequences, so the contract
is a tolerance: |out - ref| <= 2e-6 * max(1, |ref|) (a few f32 ulps); measured bit-exact in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import interpret_default
from pallas_kernels.gemm.kernel import layer_array

F32 = jnp.float32
WIDTH = 32  # the (2+hc)*hc = 24 logits padded to a power of two


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _col(m, k):
    """Column k of a [bn, WIDTH] block as a [bn] vector (a masked reduction: no value slicing in Triton)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, m.shape, 1)
    return jnp.sum(jnp.where(iota == k, m, 0.0), axis=1)


def _place(vals, width):
    """[bn] vectors -> a [bn, width] block with vals[k] in column k (zeros elsewhere)."""
    bn = vals[0].shape[0]
    iota = jax.lax.broadcasted_iota(jnp.int32, (bn, width), 1)
    out = jnp.zeros((bn, width), F32)
    for k, v in enumerate(vals):
        out = jnp.where(iota == k, v[:, None], out)
    return out


def coefficients(col, s, base, *, hc, iters, eps):
    """The Sinkhorn part inside a kernel body: col(k) = column k of the mixing logits as a [bn] f32 vector; s = the
    3 scales (f32 scalars), base(k) = base[k] (an f32 scalar). Returns (pre, post, comb) as lists of [bn] columns
    (comb flat, row-major). Shared with pallas_kernels/mega_mhc."""
    pre = [_sigmoid(col(k) * s[0] + base(k)) + eps for k in range(hc)]
    post = [2.0 * _sigmoid(col(hc + k) * s[1] + base(hc + k)) for k in range(hc)]
    c = [[col(2 * hc + i * hc + j) * s[2] + base(2 * hc + i * hc + j) for j in range(hc)] for i in range(hc)]

    def row_sum(c, i):
        acc = c[i][0]
        for j in range(1, hc):
            acc = acc + c[i][j]
        return acc

    def col_sum(c, j):
        acc = c[0][j]
        for i in range(1, hc):
            acc = acc + c[i][j]
        return acc

    for i in range(hc):  # row softmax
        mx = c[i][0]
        for j in range(1, hc):
            mx = jnp.maximum(mx, c[i][j])
        c[i] = [jnp.exp(v - mx) for v in c[i]]
        tot = row_sum(c, i)
        c[i] = [v / tot + eps for v in c[i]]

    def col_norm(c):
        den = [col_sum(c, j) + eps for j in range(hc)]
        return [[c[i][j] / den[j] for j in range(hc)] for i in range(hc)]

    c = col_norm(c)

    def body(_, flat):
        c = [list(flat[i * hc:(i + 1) * hc]) for i in range(hc)]
        den = [row_sum(c, i) + eps for i in range(hc)]
        c = [[c[i][j] / den[i] for j in range(hc)] for i in range(hc)]
        c = col_norm(c)
        return tuple(v for r in c for v in r)

    flat = jax.lax.fori_loop(0, iters - 1, body, tuple(v for r in c for v in r))
    return pre, post, list(flat)


def _kernel(layer_ref, m_ref, scale_ref, base_ref, pre_ref, post_ref, comb_ref, *, hc, iters, eps, n_rows, bn):
    r0 = pl.program_id(0) * bn
    layer = layer_ref[0]
    rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (bn,), 0)
    ok = rows < n_rows

    def col(k):  # each logit column loaded as its own vector, each scale / base entry as a scalar: no reductions
        # to pick them out of a block (they were most of a small call's time)
        return plt.load(m_ref.at[pl.ds(r0, bn), pl.ds(k, 1)], mask=ok[:, None], other=0.0).reshape(bn)

    pre, post, comb = coefficients(col, [scale_ref[layer, k] for k in range(3)], lambda k: base_ref[layer, k],
                                   hc=hc, iters=iters, eps=eps)
    plt.store(pre_ref.at[pl.ds(r0, bn), :], _place(pre, pre_ref.shape[1]), mask=ok[:, None])
    plt.store(post_ref.at[pl.ds(r0, bn), :], _place(post, post_ref.shape[1]), mask=ok[:, None])
    plt.store(comb_ref.at[pl.ds(r0, bn), :], _place(comb, comb_ref.shape[1]), mask=ok[:, None])


@functools.partial(jax.jit, static_argnames=("hc", "iters", "eps", "interpret", "block_rows"))
def _pallas(m, scale, base, layer, *, hc, iters, eps, interpret, block_rows):
    N, width = m.shape
    bn = block_rows
    hcp = max(hc, 1)
    out_shapes = (jax.ShapeDtypeStruct((N, hcp), F32), jax.ShapeDtypeStruct((N, hcp), F32),
                  jax.ShapeDtypeStruct((N, hc * hc), F32))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    pre, post, comb = pl.pallas_call(
        functools.partial(_kernel, hc=hc, iters=iters, eps=eps, n_rows=N, bn=bn),
        out_shape=out_shapes, grid=(pl.cdiv(N, bn),),
        in_specs=[any_spec] * 4,
        out_specs=(any_spec, any_spec, any_spec),
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1), interpret=interpret,
        name="hc_coefficients")(layer, m.astype(F32), scale.astype(F32), base.astype(F32))
    return pre, post, comb.reshape(N, hc, hc)


def hc_coefficients(m, scale, base, *, hc: int, iters: int, eps: float, interpret: bool | None = None,
                    block_rows: int = 32, layer=None):
    """m [..., (2+hc)*hc] f32 -> (pre [..., hc], post [..., hc], comb [..., hc, hc]). scale [3], base
    [(2+hc)*hc]; or, with `layer` (an int32 scalar), the stacks [L, 3] / [L, (2+hc)*hc], read at that row."""
    if (2 + hc) * hc > WIDTH or hc & (hc - 1):
        raise ValueError(f"hc={hc}: the kernel holds (2+hc)*hc <= {WIDTH} logits and needs hc a power of two")
    lead = m.shape[:-1]
    m2 = m.reshape(-1, m.shape[-1])
    interpret = interpret_default() if interpret is None else interpret
    stacked = scale.ndim == 2
    layer = layer_array(layer, stacked)  # checks that a stack comes with its layer and a row without one
    if not stacked:
        scale, base = scale[None], base[None]
    pre, post, comb = _pallas(m2, scale, base, layer, hc=hc, iters=iters, eps=float(eps), interpret=interpret,
                              block_rows=block_rows)
    return pre.reshape(*lead, hc), post.reshape(*lead, hc), comb.reshape(*lead, hc, hc)
