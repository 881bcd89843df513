"""Mega-Gate: the MoE router of V4.1 in one Pallas kernel (its jnp reference is the model's dsv41_jax.layers.gate,
the ops seam's XLA branch).

    s   = sqrt(softplus(x @ W^T))          x [N, D] bf16, W [E, D] (one layer of a stack, read in place), f32
    idx = top-k(s + bias)                  k = n_activated_experts; ties: the lower expert id first (lax.top_k)
    w   = s[idx] / (sum s[idx] + 1e-20) * route_scale       (without the normalisation when norm_topk_prob is off)
It emits exactly what the routed-experts op consumes: weights [N, k] f32 and expert ids [N, k] int32.

Kernel layout: grid (row blocks of bn rows, expert blocks of be, D chunks of dk). Every program computes the
[bn, be] logit partials of its chunk (plt.dot over 128-column steps, f32 accumulation: bf16 x bf16 products
are exact in f32, so only the summation order differs from the reference's f32 GEMM) and stores them in
`part` [n_dc, N, Ep]; the program of a row block that arrives last (pallas_kernels.common.last_arrival) adds
the partials in chunk order, applies sqrtsoftplus, the bias and the top-k (k passes of a max with the lowest
index among equals), normalises and scales: one launch, a few hundred bytes written per row.

Numerics contract (against the reference, random inputs; tests/kernels/test_mega_gate.py): the scores within
~1e-6 relative (summation order); the expert ids equal wherever the reference's k-th and (k+1)-th biased scores
differ by more than that (a near-tie may pick the other expert); weights within 1e-5 relative.
Requirements: E <= 1024, k <= 16, D a multiple of the chunk (a power of two >= 16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import interpret_default, last_arrival, load_uncached, sum_in_order

F32, BF16 = jnp.float32, jnp.bfloat16
SM_COUNT = 132  # H200


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class GateBlocks:
    bn: int = 16
    be: int = 64
    dk: int = 512
    num_warps: int = 4


def pick_blocks(n: int, e: int, d: int) -> GateBlocks:
    """16 rows (the dot minimum; 32 past 64 rows), experts in blocks of <= 64, and D chunks as wide as still fill
    about half a wave of programs at small N."""
    bn = 16 if n <= 64 else 32
    be = min(64, max(16, _pow2(e)))
    progs = -(-n // bn) * -(-e // be)
    dk = 1024
    while dk > 128 and (d % dk or progs * (d // dk) < SM_COUNT // 2):
        dk //= 2
    while d % dk:
        dk //= 2
    return GateBlocks(bn=bn, be=be, dk=dk, num_warps=4)


@dataclass(frozen=True)
class _Static:
    N: int
    E: int
    Ep: int
    k: int
    kp: int
    bn: int
    be: int
    dk: int
    bk: int
    n_eb: int
    n_dc: int
    route_scale: float
    normalize: bool
    interpret: bool
    warps: int = 4


def _softplus(x):
    """jax.nn.softplus's formula (logaddexp(x, 0)) with the ops Triton lowers."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _kernel(layer_ref, x_ref, w_ref, bias_ref, cnt_in, wout, iout, part, cnt, *, st: _Static):
    del cnt_in  # aliased to cnt
    rb, eb, dc = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    r0 = rb * st.bn
    ok = (r0 + jax.lax.broadcasted_iota(jnp.int32, (st.bn, 1), 0)) < st.N
    e0, d0 = eb * st.be, dc * st.dk
    eok = (e0 + jax.lax.broadcasted_iota(jnp.int32, (st.be, 1), 0)) < st.E

    def step(i, acc):
        dd = d0 + i * st.bk
        x = plt.load(x_ref.at[pl.ds(r0, st.bn), pl.ds(dd, st.bk)], mask=ok, other=0.0)
        w = plt.load(w_ref.at[layer, pl.ds(e0, st.be), pl.ds(dd, st.bk)], mask=eok, other=0.0)
        if w.dtype == F32:
            return acc + plt.dot(x.astype(F32), w, trans_b=True, allow_tf32=False)
        return acc + plt.dot(x.astype(w.dtype), w, trans_b=True)

    acc = jax.lax.fori_loop(0, st.dk // st.bk, step, jnp.zeros((st.bn, st.be), F32))
    plt.store(part.at[dc, pl.ds(r0, st.bn), pl.ds(e0, st.be)], acc, mask=ok)

    @pl.when(last_arrival(cnt, rb, st.n_eb * st.n_dc, st.interpret))
    def _epilogue():
        z = rb * 0  # a traced 0: the padded expert columns are a masked, not an out-of-bound, slice
        cols = jax.lax.broadcasted_iota(jnp.int32, (1, st.Ep), 1)
        eok_c = cols < st.E

        logits = sum_in_order(  # chunk order; the loads overlap in groups
            lambda c: load_uncached(part.at[z + c, pl.ds(r0, st.bn), pl.ds(z, st.Ep)], mask=ok & eok_c, other=0.0),
            st.n_dc, jnp.zeros((st.bn, st.Ep), F32), regs_per_load=st.bn * st.Ep // (32 * st.warps))
        s = jnp.sqrt(_softplus(logits))
        bias = plt.load(bias_ref.at[layer, pl.ds(z, st.Ep)], mask=eok_c[0], other=0.0).astype(F32)
        sb = jnp.where(eok_c, s + bias[None, :], -jnp.inf)
        kcols = jax.lax.broadcasted_iota(jnp.int32, (1, st.kp), 1)
        ids = jnp.zeros((st.bn, st.kp), jnp.int32)
        ws = jnp.zeros((st.bn, st.kp), F32)
        wsum = None
        for j in range(st.k):
            mx = jnp.max(sb, axis=1, keepdims=True)
            pick = jnp.min(jnp.where(sb == mx, cols, st.Ep), axis=1, keepdims=True)  # lowest id among equals
            hit = cols == pick
            wj = jnp.sum(jnp.where(hit, s, 0.0), axis=1, keepdims=True)
            sb = jnp.where(hit, -jnp.inf, sb)
            ids = jnp.where(kcols == j, pick, ids)
            ws = jnp.where(kcols == j, wj, ws)
            wsum = wj if wsum is None else wsum + wj
        if st.normalize:
            ws = ws / (wsum + 1e-20)
        kok = ok & (kcols < st.k)
        plt.store(wout.at[pl.ds(r0, st.bn), pl.ds(z, st.kp)], ws * st.route_scale, mask=kok)
        plt.store(iout.at[pl.ds(r0, st.bn), pl.ds(z, st.kp)], ids, mask=kok)


@functools.partial(jax.jit, static_argnames=("st", "num_warps"))
def _call(layer, x, w, bias, *, st: _Static, num_warps: int):
    n_rb = pl.cdiv(st.N, st.bn)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    sds = jax.ShapeDtypeStruct
    outs = pl.pallas_call(
        functools.partial(_kernel, st=st), grid=(n_rb, st.n_eb, st.n_dc), in_specs=[any_] * 5,
        out_shape=(sds((st.N, st.k), F32), sds((st.N, st.k), jnp.int32), sds((st.n_dc, st.N, st.Ep), F32),
                   sds((n_rb,), jnp.int32)),
        out_specs=(any_,) * 4, input_output_aliases={4: 3},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1), interpret=st.interpret,
        name="mega_gate")(layer, x, w, bias, jnp.zeros((n_rb,), jnp.int32))
    return outs[0], outs[1]


def route(x, weight, bias, *, k: int, route_scale: float, norm_topk_prob: bool, layer=None,
          blocks: GateBlocks | None = None, interpret: bool | None = None):
    """x [N, D]; weight [(L,) E, D] (bf16 or f32); bias [(L,) E] f32; layer: int32 index into stacked weights
    (None: unstacked). Returns (weights [N, k] f32, expert ids [N, k] int32): layers.gate's outputs."""
    N, D = x.shape
    stacked = weight.ndim == 3
    if stacked != (layer is not None):
        raise ValueError("mega_gate: a stacked weight needs `layer` (and an unstacked one none)")
    if not stacked:
        weight, bias = weight[None], bias[None]
    E = weight.shape[1]
    if E > 1024 or k > 16 or k > E:
        raise ValueError(f"mega_gate: E={E}, k={k} (E <= 1024, k <= 16)")
    b = blocks or pick_blocks(N, E, D)
    Ep = max(_pow2(E), b.be)
    if D % b.dk or b.dk < 16 or b.dk & (b.dk - 1) or b.bn < 16 or b.be < 16 or b.be & (b.be - 1):
        raise ValueError(f"mega_gate: D={D} with blocks {b} (power-of-two blocks >= 16, dk | D)")
    interpret = interpret_default() if interpret is None else interpret
    st = _Static(N=N, E=E, Ep=Ep, k=k, kp=max(_pow2(k), 2), bn=b.bn, be=b.be, dk=b.dk, bk=min(b.dk, 128),
                 n_eb=-(-E // b.be), n_dc=D // b.dk, route_scale=float(route_scale),
                 normalize=bool(norm_topk_prob and k > 1), interpret=interpret, warps=b.num_warps)
    lay = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    return _call(lay, x.astype(BF16), weight, bias.astype(F32), st=st, num_warps=b.num_warps)
