"""FP8 x FP8 small-M GEMM on FP8 block-32 weights (GemmBlock.decode == "fp8"): y = x @ dequant(w)^T, f32.

    matmul_fp8(xq [M, K] uint8 E4M3 codes, sx [M, K/32] f32, w [L, N, K] e4m3, codes [L, N/32, K/32] uint8,
               layer [1] int32, blk) -> [M, N] f32
    (sx None: xq is x itself, bf16 / f32, quantised in the kernel as it is loaded: pallas_kernels/act_quant.py)

The weight tile goes to the tensor core as stored (no decode): the block-32 scales of both operands are applied
to f32 per-block sums (pallas_kernels/fp8dot.py: the x tile is expanded block-diagonally over the MMA's rows).
GemmBlock fields: bm = R rows of x per program (the M tile), nb = k blocks per dot (R * nb = the MMA's rows),
bk = k per loop step (bk / (32 nb) dots, each on its own [bn, 32 nb] weight load), bn, splits (K ranges whose f32
partials the wrapper sums), swap (weight tile as the dot's first operand), fast_accum (FP8 wgmma with Hopper's
FP8 accumulator inside each dot, pallas_kernels/fp8dot.py), prefetch (the small loads of a step issued one step
ahead: `small` in _kernel). Grid (M tiles, N tiles, splits).
x rows past M are masked at the loads; the output is padded to whole M tiles (see kernel.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import act_quant, fp8dot
from pallas_kernels.gemm.block_sizes import GemmBlock

F32 = jnp.float32


def _kernel(layer_ref, x_ref, *refs, blk: GemmBlock, ksteps: int, m_rows: int, fast: bool, quantize: bool):
    sx_ref, w_ref, s_ref, o_ref = (None, *refs) if quantize else refs
    R, nb, bn = blk.bm, blk.nb, blk.bn
    ksub = 32 * nb
    nsub = blk.bk // ksub
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    m0 = pl.multiple_of(i * R, R)
    n0 = pl.multiple_of(j * bn, bn)
    rmask = (m0 + jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0)) < m_rows
    kb_base = s * (ksteps * blk.bk // 32)

    def small(t):
        """Step t's x tiles, x scales and weight scale codes, per dot (blk.prefetch: loaded one step ahead)."""
        out = []
        for u in range(nsub):
            kb = kb_base + (t * nsub + u) * nb  # first k block of this dot
            k0 = pl.multiple_of(kb * 32, ksub)
            xt = plt.load(x_ref.at[pl.ds(m0, R), pl.ds(k0, ksub)], mask=rmask, other=0)
            if quantize:  # x's FP8 codes and block multipliers from its bf16 / f32 values, as the model's rule
                xt, sx = act_quant.quantize_tile(xt)
            else:
                sx = plt.load(sx_ref.at[pl.ds(m0, R), pl.ds(kb, nb)], mask=rmask, other=0.0)
            out.append((xt, sx, s_ref[layer, pl.ds(j * (bn // 32), bn // 32), pl.ds(kb, nb)]))
        return tuple(out)

    def step(t, acc, loads):
        for u in range(nsub):
            k0 = pl.multiple_of((kb_base + (t * nsub + u) * nb) * 32, ksub)
            xt, sx, sc = loads[u]
            wt = plt.load(w_ref.at[layer, pl.ds(n0, bn), pl.ds(k0, ksub)], eviction_policy="evict_first")
            sw = fp8dot.expand_rows(fp8dot.pow2(sc), 32)
            p = fp8dot.dot(fp8dot.block_diag(xt, nb, 32), wt, blk.swap, fast)
            acc = acc + p * fp8dot.scale_grid(sx, sw, blk.swap)
        return acc

    shape = (bn, R * nb) if blk.swap else (R * nb, bn)
    if blk.prefetch:
        def body(t, carry):
            nxt = small(jnp.minimum(t + 1, ksteps - 1))
            return step(t, carry[0], carry[1]), nxt

        acc, _ = jax.lax.fori_loop(0, ksteps, body, (jnp.zeros(shape, F32), small(0)))
    else:
        acc = jax.lax.fori_loop(0, ksteps, lambda t, a: step(t, a, small(t)), jnp.zeros(shape, F32))
    y = fp8dot.fold(acc, R, nb, blk.swap)
    o_ref[...] = y.T if blk.swap else y


@functools.partial(jax.jit, static_argnames=("blk", "interpret"))
def matmul_fp8(xq, sx, w, codes, layer, *, blk: GemmBlock, interpret: bool):
    M, K = xq.shape
    _, N, _ = w.shape
    ksteps = K // blk.bk // blk.splits
    m_tiles = -(-M // blk.bm)
    anyspec = pl.BlockSpec(memory_space=pl.ANY)
    args = [layer, xq] + ([] if sx is None else [sx]) + [w, codes]
    out = pl.pallas_call(
        functools.partial(_kernel, blk=blk, ksteps=ksteps, m_rows=M, fast=blk.fast_accum and not interpret,
                          quantize=sx is None),
        out_shape=jax.ShapeDtypeStruct((blk.splits, m_tiles * blk.bm, N), F32),
        grid=(m_tiles, N // blk.bn, blk.splits),
        in_specs=[anyspec] * len(args),
        out_specs=pl.BlockSpec((None, blk.bm, blk.bn), lambda i, j, s: (s, i, j)),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=blk.num_stages),
        interpret=interpret,
        name="gemm_fp8xfp8",
    )(*args)
    return (out[0] if blk.splits == 1 else jnp.sum(out, axis=0))[:M]
