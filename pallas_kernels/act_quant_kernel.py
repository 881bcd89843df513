"""FP8 activation quantisation of a whole [M, K] array in one launch: the E4M3 codes and the f32 block multipliers
that the FP8 GEMM and MoE kernels read (`x_scale` as multipliers: pallas_kernels/gemm/kernel.py `x_multipliers`).

    quantize(x [M, K] bf16 / f32) -> (codes [M, K] uint8 E4M3, mult [M, K/32] f32 = 2^(UE8M0 code - 127))
    quantize_ref(x): the same in XLA

Why: in XLA the same values take up to three kernels per linear input (the block amax reduction, the codes, and
the conversion of the scale codes to the multipliers the kernels multiply by), some of them fused with the input's
producer; what one launch saves in a decode step is counted in docs/BENCHMARKS.md. The rule is
pallas_kernels/act_quant.py's, applied to [bm, bk] tiles (bk a multiple of 32, so blocks never straddle tiles):
the outputs equal dsv41_jax.quant.fp8_encode's bit for bit (tests/kernels/test_act_quant_kernel.py).

Tiles: bm divides M (a power of two <= 16; the Triton lowering does not mask a block that overhangs an array),
bk the largest power of two <= 1024 that divides K, so K must be a multiple of 32. Grid (M / bm, K / bk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import act_quant
from pallas_kernels.common import interpret_default

F32 = jnp.float32
MAX_TILE = 8192  # elements of one program's tile (registers)


def tiles(M: int, K: int) -> tuple[int, int]:
    """(bm, bk) for an [M, K] array; see the module docstring."""
    if K % act_quant.BLOCK or M < 1:
        raise ValueError(f"act_quant_kernel: x [M, K] needs M >= 1 and K % {act_quant.BLOCK} == 0, got {(M, K)}")
    bk = 1024
    while K % bk:
        bk //= 2
    bm = 1
    while bm < 16 and M % (2 * bm) == 0 and 2 * bm * bk <= MAX_TILE:
        bm *= 2
    return bm, bk


def _kernel(x_ref, q_ref, m_ref):
    q, mult = act_quant.quantize_tile(x_ref[...])
    q_ref[...] = q
    m_ref[...] = mult


@functools.partial(jax.jit, static_argnames=("interpret",))
def _quantize(x, *, interpret: bool):
    M, K = x.shape
    bm, bk = tiles(M, K)
    nb = bk // act_quant.BLOCK
    return pl.pallas_call(
        _kernel,
        out_shape=(jax.ShapeDtypeStruct((M, K), jnp.uint8), jax.ShapeDtypeStruct((M, K // act_quant.BLOCK), F32)),
        grid=(M // bm, K // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j: (i, j))],
        out_specs=(pl.BlockSpec((bm, bk), lambda i, j: (i, j)), pl.BlockSpec((bm, nb), lambda i, j: (i, j))),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="act_quant",
    )(x)


def quantize(x, *, interpret=None):
    """x [M, K] (bf16 / f32) -> (uint8 E4M3 codes [M, K], f32 multipliers [M, K/32]) in one kernel."""
    if x.ndim != 2:
        raise ValueError(f"act_quant_kernel.quantize: x must be [M, K], got {x.shape}")
    tiles(*x.shape)  # the shape check, before tracing
    return _quantize(x, interpret=interpret_default() if interpret is None else interpret)


def quantize_ref(x):
    """The XLA reference: the same rule on the whole array (act_quant.quantize_tile)."""
    return act_quant.quantize_tile(x)
