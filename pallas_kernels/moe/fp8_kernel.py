"""FP8 x FP8 grouped GEMMs on MXFP4 experts in the checkpoint's own byte layout (MoeBlock.decode == "fp8").

    gmm_fp8(xq [M, K] uint8 E4M3 codes, sx [M, K/32] f32, w [L, E, N, K/2] uint8, codes [L, E, N, K/32] uint8,
            group_sizes, layer [1], blk) -> [M, N] f32
    swiglu_fp8(xq, sx, w1, c1, w3, c3, group_sizes, route_w, layer, blk, limit, dtype) -> h [M, N] dtype
    (sx None: xq is x itself, bf16 / f32, quantised in the kernel as its planes are loaded: act_quant.py)

A [bn, 16 nb] tile of packed bytes (nb blocks of 32 k per row) becomes two E4M3 planes with ~5 integer ops per 8
weights (fp_decode.e2m1_e4m3_planes: lo = even k, hi = odd k, each e2m1 * 2^-6, no scale); the x rows of the item
arrive split the same way (x_even [M, K/2], x_odd [M, K/2], made by the wrapper), expanded block-diagonally
(pallas_kernels/fp8dot.py), and the two planes' dots give each block's sum: P = A_lo . lo^T + A_hi . hi^T; the
block scales (sx of the x rows, 2^(s - 127 + 6) of the weights) multiply P, and the blocks are summed at the end.
MoeBlock fields: bm = R rows per work item (tile_metadata with bm = R), nb (R * nb = the MMA's rows), bk = k per
loop step (bk / (32 nb) sub-tile loads per step), bn, splits, swap (weight planes as the dots' first operand;
the output is then produced transposed, [N, M], and the wrapper transposes it), fast_accum (FP8 wgmma, see
pallas_kernels/fp8dot.py), prefetch (a step's small loads one step ahead), w13 (swiglu_fp8's weight schedule:
"joint" = w1 and w3 tiles in one k loop; "serial" = w1's loop then w3's in one program; "grid" = one weight per
program, f32 g / u partials finished by the wrapper; block_sizes.W13_MODES).

Work list, masking and the zero-initialised aliased output as in kernel.py (pallas_kernels/moe/worklist.py).
Numerics: pallas_kernels/fp8dot.py (products exact; f32 sums with the 16-row MMA). grouped_swiglu: the fused
epilogue of worklist.swiglu_rows on the folded g and u.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import act_quant, fp8dot
from pallas_kernels.fp_decode import E4M3_FROM_E2M1_LOG2, e2m1_e4m3_planes
from pallas_kernels.moe.block_sizes import MoeBlock
from pallas_kernels.moe.worklist import call, item, meta, out_buffer, swiglu_rows

F32 = jnp.float32


def _sum_blocks(refs, ws, layer, e, r0, rmask, n0, k_lo, ksteps, blk: MoeBlock, interp: bool):
    """For each (w_ref, s_ref) of `ws`: the item's f32 [R, bn] (swap: [bn, R]) over k steps [k_lo, k_lo +
    ksteps); the x tiles (refs: x_even, x_odd, sx) are loaded once per sub-tile for all weights.
    blk.prefetch: the step's small loads (x tiles, x scales, weight scale codes), which Triton's pipeliner leaves
    as plain global loads, are issued one step ahead and carried through the loop, so their latency overlaps the
    current step's decode and dots instead of stalling it."""
    xe_ref, xo_ref, sx_ref = refs  # sx_ref None: x's planes are raw values, quantised here
    R, nb, bn = blk.bm, blk.nb, blk.bn
    cb = 16 * nb  # packed bytes per row of one sub-tile
    nsub = blk.bk // (32 * nb)

    def small(t):
        """The small loads of step t: per sub-tile (x_lo, x_hi, sx, (weight scale codes per weight))."""
        out = []
        for u in range(nsub):
            kb = (k_lo + t) * (blk.bk // 32) + u * nb  # first k block of the sub-tile
            c0 = pl.multiple_of(kb * 16, cb)
            x_lo = plt.load(xe_ref.at[pl.ds(r0, R), pl.ds(c0, cb)], mask=rmask, other=0)
            x_hi = plt.load(xo_ref.at[pl.ds(r0, R), pl.ds(c0, cb)], mask=rmask, other=0)
            if sx_ref is None:
                x_lo, x_hi, sx = act_quant.quantize_planes(x_lo, x_hi)
            else:
                sx = plt.load(sx_ref.at[pl.ds(r0, R), pl.ds(kb, nb)], mask=rmask, other=0.0)
            out.append((x_lo, x_hi, sx, tuple(s_ref[layer, e, pl.ds(n0, bn), pl.ds(kb, nb)] for _, s_ref in ws)))
        return tuple(out)

    def step(t, accs, loads):
        for u in range(nsub):
            c0 = pl.multiple_of(((k_lo + t) * (blk.bk // 32) + u * nb) * 16, cb)
            x_lo, x_hi, sx, scodes = loads[u]
            a_lo, a_hi = fp8dot.block_diag(x_lo, nb, 16), fp8dot.block_diag(x_hi, nb, 16)
            new = []
            for acc, (w_ref, _), sc in zip(accs, ws, scodes):
                b = plt.load(w_ref.at[layer, e, pl.ds(n0, bn), pl.ds(c0, cb)], eviction_policy="evict_first")
                lo, hi = (jax.lax.bitcast_convert_type(q, fp8dot.E4M3) for q in e2m1_e4m3_planes(b, interpret=interp))
                sw = fp8dot.pow2(sc, -E4M3_FROM_E2M1_LOG2)
                fast = blk.fast_accum and not interp
                p = fp8dot.dot(a_lo, lo, blk.swap, fast) + fp8dot.dot(a_hi, hi, blk.swap, fast)
                new.append(acc + p * fp8dot.scale_grid(sx, sw, blk.swap))
            accs = tuple(new)
        return accs

    shape = (bn, R * nb) if blk.swap else (R * nb, bn)
    zeros = tuple(jnp.zeros(shape, F32) for _ in ws)
    if blk.prefetch:
        def body(t, carry):
            nxt = small(jnp.minimum(t + 1, ksteps - 1))
            return step(t, carry[0], carry[1]), nxt

        accs, _ = jax.lax.fori_loop(0, ksteps, body, (zeros, small(0)))
    else:
        accs = jax.lax.fori_loop(0, ksteps, lambda t, a: step(t, a, small(t)), zeros)
    return [fp8dot.fold(a, R, nb, blk.swap) for a in accs]


def _store(o_ref, idx, val, rmask, blk: MoeBlock):
    """Store an [R, bn] tile (swap: [bn, R] into the transposed buffer) at rows r0 / columns n0 of o_ref[idx]."""
    lead, r0, n0 = idx
    if blk.swap:
        plt.store(o_ref.at[(*lead, pl.ds(n0, blk.bn), pl.ds(r0, blk.bm))], val, mask=rmask.T)
    else:
        plt.store(o_ref.at[(*lead, pl.ds(r0, blk.bm), pl.ds(n0, blk.bn))], val, mask=rmask)


def _x_refs(refs, quantize: bool):
    """(x_even, x_odd, sx or None), the rest of the refs."""
    if quantize:
        return (refs[0], refs[1], None), refs[2:]
    return tuple(refs[:3]), refs[3:]


def _gmm_kernel(layer_ref, meta_ref, *refs, blk: MoeBlock, ksteps: int, interpret: bool, quantize: bool):
    (xe_ref, xo_ref, sx_ref), (w_ref, s_ref, _, o_ref) = _x_refs(refs, quantize)
    e, r0, lo, hi, rmask, n0 = item(meta_ref, blk, xe_ref.shape[0])
    sp = pl.program_id(2)

    @pl.when(hi > lo)
    def _():
        [y] = _sum_blocks((xe_ref, xo_ref, sx_ref), [(w_ref, s_ref)], layer_ref[0], e, r0, rmask, n0, sp * ksteps,
                          ksteps, blk, interpret)
        _store(o_ref, ((sp,), r0, n0), y, rmask, blk)


def _swiglu_kernel(layer_ref, meta_ref, *refs, blk: MoeBlock, ksteps: int, limit: float, dtype, interpret: bool,
                   quantize: bool):
    xs, (w1_ref, s1_ref, w3_ref, s3_ref, rw_ref, _, o_ref) = _x_refs(refs, quantize)
    e, r0, lo, hi, rmask, n0 = item(meta_ref, blk, xs[0].shape[0])
    q = pl.program_id(2)
    if blk.w13 == "grid":  # program q: weight q % 2 (0: w1 -> g, 1: w3 -> u) of split q // 2, into partial q
        sp = q // 2
        for which, ws in ((0, (w1_ref, s1_ref)), (1, (w3_ref, s3_ref))):
            @pl.when((hi > lo) & (q % 2 == which))
            def _(ws=ws):
                [y] = _sum_blocks(xs, [ws], layer_ref[0], e, r0, rmask, n0, sp * ksteps, ksteps, blk, interpret)
                _store(o_ref, ((q,), r0, n0), y, rmask, blk)
        return
    sp = q

    @pl.when(hi > lo)
    def _():
        args = (layer_ref[0], e, r0, rmask, n0, sp * ksteps, ksteps, blk, interpret)
        if blk.w13 == "serial":  # w1's k loop, then w3's: one weight's decoded planes live at a time
            [g], [u] = _sum_blocks(xs, [(w1_ref, s1_ref)], *args), _sum_blocks(xs, [(w3_ref, s3_ref)], *args)
        else:
            g, u = _sum_blocks(xs, [(w1_ref, s1_ref), (w3_ref, s3_ref)], *args)
        if len(o_ref.shape) == 3:  # split K: f32 partials [2 * split + (0: g, 1: u)], the wrapper finishes
            _store(o_ref, ((2 * sp,), r0, n0), g, rmask, blk)
            _store(o_ref, ((2 * sp + 1,), r0, n0), u, rmask, blk)
            return
        rw = plt.load(rw_ref.at[pl.ds(r0, blk.bm)], mask=rmask[:, 0], other=0.0)
        h = swiglu_rows(g, u, rw[None, :] if blk.swap else rw[:, None], limit, dtype)
        _store(o_ref, ((), r0, n0), h.astype(o_ref.dtype), rmask, blk)


def _x_planes(xq, sx):
    """x [M, K] (uint8 E4M3 codes, or raw values when sx is None) -> [even k, odd k ([M, K/2] each, the k order
    of the lo / hi weight planes), sx if given]: the kernels' x operands."""
    return [xq[:, 0::2], xq[:, 1::2]] + ([] if sx is None else [sx])


def _out_init(shape, dtype):
    """The output buffer the kernels store into (aliased): zeros, so rows no work item owns (padding) read 0. A
    seam for the tests, which poison it to check that every owned element is written."""
    return jnp.zeros(shape, dtype)


def _out(y, blk: MoeBlock):
    return jnp.swapaxes(y, -1, -2) if blk.swap else y


@functools.partial(jax.jit, static_argnames=("blk", "interpret", "owned"))
def gmm_fp8(xq, sx, w, codes, group_sizes, layer, work=None, *, blk: MoeBlock, interpret: bool, owned: bool = False):
    M, K = xq.shape
    _, E, N, _ = w.shape
    n_items, work = meta(group_sizes, M, E, blk, work)
    S = blk.splits
    shape = (S, N, M) if blk.swap else (S, M, N)
    args = [layer, work, *_x_planes(xq, sx), w, codes, out_buffer(shape, F32, owned, _out_init)]
    y = call(functools.partial(_gmm_kernel, blk=blk, ksteps=K // blk.bk // S, interpret=interpret,
                               quantize=sx is None), args,
             jax.ShapeDtypeStruct(shape, F32), (n_items, N // blk.bn, S), blk, interpret, "moe_gmm_fp8")
    return _out(y[0] if S == 1 else jnp.sum(y, axis=0), blk)


@functools.partial(jax.jit, static_argnames=("blk", "interpret", "limit", "dtype", "owned"))
def swiglu_fp8(xq, sx, w1, c1, w3, c3, group_sizes, route_w, layer, *, blk: MoeBlock, interpret: bool,
               limit: float, dtype, owned: bool = False):
    M, K = xq.shape
    _, E, N, _ = w1.shape
    n_items, work = meta(group_sizes, M, E, blk)
    S = blk.splits
    tile = (N, M) if blk.swap else (M, N)
    partials = S > 1 or blk.w13 == "grid"
    out = ((2 * S, *tile), F32) if partials else (tile, dtype)
    args = [layer, work, *_x_planes(xq, sx), w1, c1, w3, c3, route_w.astype(F32), out_buffer(*out, owned, _out_init)]
    y = call(functools.partial(_swiglu_kernel, blk=blk, ksteps=K // blk.bk // S, limit=limit, dtype=dtype,
                               interpret=interpret, quantize=sx is None),
             args, jax.ShapeDtypeStruct(*out),
             (n_items, N // blk.bn, 2 * S if blk.w13 == "grid" else S), blk, interpret, "moe_swiglu_fp8")
    if not partials:
        return _out(y, blk)
    gu = _out(jnp.sum(y.reshape(S, 2, *tile), axis=0), blk)
    return swiglu_rows(gu[0], gu[1], route_w.astype(F32)[:, None], limit, dtype).astype(dtype)
