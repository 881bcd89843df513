"""Mega-mHC: one sublayer boundary of single-pass mHC in one Pallas kernel (its jnp reference is the model's
dsv41_jax.layers.hc_boundary, the ops seam's XLA branch).

At a boundary the residual stream h [N, hc, D] (bf16) still owes the previous sublayer's output y [N, D]:
    h'   = hc_post(y, h, post, comb)                     post, comb, pre from `mix` (the previous boundary's
    x    = RMSNorm(hc_pre(h', pre), norm_w)              mixes: single-pass mHC's delayed pre-mix)
    mix' = (pre', post', comb') = Sinkhorn(RMS(h') * (flatten(h') @ fn^T) * scale + base)     the next mixes
    xq   = fp8_qdq(x, 32)                                the next FP8 GEMMs' input (quantize=True)
Mixes travel packed as [N, (2+hc)*hc] f32: pre | post | comb (row-major), the layout of the mixing logits
(dsv41_jax.layers.hc_split).

Kernel layout: grid (row blocks of `bn` rows, D chunks of `dk` columns, walked in [bn, bk] steps). Phase 1
(every program) computes its chunk of h' (stored), of the unnormalised hc_pre (stored into x's buffer, bf16 as
the reference rounds it) and f32 partials per row: the chunk's 24 logit partial sums (h'[bn, bk] is bf16, and
fn's f32 [32, bk] slice per copy is split into three bf16 terms that sum to it exactly (common.split_bf16x3), so
three bf16 tensor-core dots with f32 accumulation give the f32 products exactly: an f32 FMA dot stalled on its
shared-memory operand loads, 23.4 -> 6.6 us traced at one row on an H100), sum h'^2 and sum x^2; it stores
them in `part` [n_dc, N, 32].
The epilogue needs every chunk:
  single_launch=False (default): the epilogue as a second kernel with grid (row blocks, chunks) (no atomics);
  single_launch=True: each program bumps its row block's counter (an atomic add, acquire-release, after a CTA
      barrier); the program that arrives last adds the partials in chunk order (deterministic), runs the
      Sinkhorn, stores mix', and rescales its rows' x in place (then xq): one launch per boundary, but its last
      program works alone: 31.6 us against 24.5 for two launches at one row (H100, bench/results/
      mega_mhc_ablation_tc_h100.json; 59.0 against 35.2 at 8 rows before the tensor-core logits).
Both variants compute the same values. Only `part`'s counter needs zeroing per call (a tiny memset XLA emits).

Numerics contract (against the reference, random inputs; measured in tests/kernels/test_mega_mhc.py):
- h' and the unnormalised hc_pre: the reference's f32 operations in its order, rounded to bf16 (the GPU may fuse
  multiply-adds, so a few elements may differ by one bf16 ulp);
- mix': the logits' f32 sums run in another order than XLA's GEMM (chunked), then the Sinkhorn of
  pallas_kernels.mhc; |mix' - ref| <= 1e-5 * max(1, |ref|) on most rows, but the Sinkhorn can amplify the sum
  order's last-ulp differences (a random row at D = 1024 in tests/kernels/test_mega_mhc.py: 6e-5);
- x: the RMS statistic is summed in chunk order, so x may differ from the reference by one bf16 ulp in rare
  elements, and by a few where an h' copy it sums is an ulp off (measured in interpret mode at D = 1024); xq is
  exactly fp8_qdq(x) of the kernel's x (UE8M0 scale from the f32 bits, E4M3 round-to-nearest-even) and therefore
  equals the reference wherever x does.
Requirements: hc a power of two with (2+hc)*hc <= 32; D a multiple of 32 (and of the chunk); N >= 1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import (
    fp8_qdq_block,
    interpret_default,
    last_arrival,
    load_uncached,
    split_bf16x3,
    sum_in_order,
)
from pallas_kernels.mhc.kernel import WIDTH, _col, _place, coefficients

F32, BF16 = jnp.float32, jnp.bfloat16
SM_COUNT = 132  # H200
COL_SSH, COL_SSX = 30, 31  # partial-sum columns of `part` past the (2+hc)*hc logits
MAX_UNROLL = 64  # normalisation steps up to this many are unrolled (their loads then overlap)
NORM_TILE = 4096  # elements of x a normalisation step holds (rows x columns): 16 f32 a thread at 8 warps


@dataclass(frozen=True)
class MhcBlocks:
    """bn rows x dk columns per program (walked in [bn, min(dk, 4096 / bn)] steps); num_warps of the launch."""
    bn: int = 16
    dk: int = 256
    num_warps: int = 4


def pick_blocks(n: int, d: int) -> MhcBlocks:
    """16-row blocks (the plt.dot minimum) up to 64 rows, then 32; the widest chunk (<= 1024) that divides D and
    still gives about half a wave of programs at small N (more chunks: more partials for the epilogue to add);
    8 warps (at 4 the kernel needs more than 255 registers a thread and spills: ptxas for sm_90a at D = 5120 gives
    255 registers and a 608-1,040-byte stack at N = 1 / 8 / 32 with 4 warps, 95-113 registers and none with 8:
    bench/results/mega_mhc_sass_cpu.json, tools/kernel_sass.py; on an H100 4 warps were 5% slower at N = 1)."""
    bn = 16 if n <= 64 else 32
    n_rb = -(-n // bn)
    dk = 1024
    while dk > 128 and (d % dk or n_rb * (d // dk) < SM_COUNT // 2):
        dk //= 2
    while d % dk:
        dk //= 2
    return MhcBlocks(bn=bn, dk=max(dk, 32), num_warps=8)


@dataclass(frozen=True)
class _Static:
    N: int
    D: int
    hc: int
    bn: int
    dk: int
    bk: int
    n_dc: int
    iters: int
    eps: float
    norm_eps: float
    quantize: bool
    interpret: bool
    warps: int = 4


def _rows(st: _Static, rb):
    r0 = rb * st.bn
    rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (st.bn,), 0)
    return r0, (rows < st.N)[:, None]


def _zero(rb):
    """A traced 0: a column slice wider than its array (masked) must not be a static out-of-bound slice."""
    return rb * 0


def _cols(n):
    return jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)


def _phase1(st: _Static, rb, dc, layer, y_ref, h_ref, mix_ref, fn_ref, h_out, x_out, part):
    """h', the unnormalised hc_pre and the f32 partials of one [bn, dk] chunk, in [bn, bk] steps."""
    hc, D = st.hc, st.D
    mw = (2 + hc) * hc
    r0, ok = _rows(st, rb)
    cw = _cols(WIDTH) < mw
    z = _zero(rb)
    mix = plt.load(mix_ref.at[pl.ds(r0, st.bn), pl.ds(z, WIDTH)], mask=ok & cw, other=0.0)
    post = [_col(mix, hc + j) for j in range(hc)]
    comb = [[_col(mix, 2 * hc + i * hc + j) for j in range(hc)] for i in range(hc)]
    pre = [_col(mix, j) for j in range(hc)]
    frows = jax.lax.broadcasted_iota(jnp.int32, (WIDTH, 1), 0) < mw

    def step(t, carry):
        m, ssh, ssx = carry
        d0 = dc * st.dk + t * st.bk
        y = plt.load(y_ref.at[pl.ds(r0, st.bn), pl.ds(d0, st.bk)], mask=ok, other=0.0).astype(F32)
        hv = [plt.load(h_ref.at[pl.ds(r0, st.bn), pl.ds(i * D + d0, st.bk)], mask=ok, other=0.0).astype(F32)
              for i in range(hc)]
        xs = None
        for j in range(hc):
            mixj = comb[0][j][:, None] * hv[0]
            for i in range(1, hc):
                mixj = mixj + comb[i][j][:, None] * hv[i]
            hn = (post[j][:, None] * y + mixj).astype(BF16)
            plt.store(h_out.at[pl.ds(r0, st.bn), pl.ds(j * D + d0, st.bk)], hn, mask=ok)
            hf = hn.astype(F32)
            ssh = ssh + jnp.sum(hf * hf, axis=1)
            term = pre[j][:, None] * hf
            xs = term if xs is None else xs + term
            fnj = plt.load(fn_ref.at[layer, pl.ds(z, WIDTH), pl.ds(j * D + d0, st.bk)], mask=frows, other=0.0)
            for part in split_bf16x3(fnj):  # h' is bf16: three bf16 tensor-core dots give the f32 products exactly
                m = m + plt.dot(hn, part, trans_b=True)
        xb = xs.astype(BF16)
        plt.store(x_out.at[pl.ds(r0, st.bn), pl.ds(d0, st.bk)], xb, mask=ok)
        xf = xb.astype(F32)
        return m, ssh, ssx + jnp.sum(xf * xf, axis=1)

    zero = jnp.zeros((st.bn,), F32)
    m, ssh, ssx = jax.lax.fori_loop(0, st.dk // st.bk, step, (jnp.zeros((st.bn, WIDTH), F32), zero, zero))
    cols = _cols(WIDTH)
    m = jnp.where(cols == COL_SSH, ssh[:, None], jnp.where(cols == COL_SSX, ssx[:, None], m))
    plt.store(part.at[dc, pl.ds(r0, st.bn), pl.ds(z, WIDTH)], m, mask=ok)


def _partials(st: _Static, rb, part):
    """The partials of row block rb summed in chunk order ([bn, WIDTH]); loads bypass L1 (other programs wrote
    them during this launch) and overlap in groups (common.sum_in_order)."""
    r0, ok = _rows(st, rb)
    z = _zero(rb)  # traced chunk indices (interpret mode rejects a static int index here)
    return sum_in_order(lambda k: load_uncached(part.at[z + k, pl.ds(r0, st.bn), pl.ds(0, WIDTH)], mask=ok,
                                                other=0.0),
                        st.n_dc, jnp.zeros((st.bn, WIDTH), F32), regs_per_load=st.bn * WIDTH // (32 * st.warps))


def _mixes(st: _Static, rb, layer, acc, scale_ref, base_ref, mix_out):
    hc = st.hc
    mw = (2 + hc) * hc
    r0, ok = _rows(st, rb)
    r = jax.lax.rsqrt(_col(acc, COL_SSH) / (hc * st.D) + st.norm_eps)
    m = acc * r[:, None]
    z = _zero(rb)
    sv = plt.load(scale_ref.at[layer, pl.ds(z, 4)], mask=jax.lax.broadcasted_iota(jnp.int32, (4,), 0) < 3,
                  other=0.0)
    bv = plt.load(base_ref.at[layer, pl.ds(z, WIDTH)], mask=_cols(WIDTH)[0] < mw, other=0.0)
    i4, iw = jax.lax.broadcasted_iota(jnp.int32, (4,), 0), jax.lax.broadcasted_iota(jnp.int32, (WIDTH,), 0)
    s = [jnp.sum(jnp.where(i4 == k, sv, 0.0)) for k in range(3)]
    pre, post, comb = coefficients(lambda k: _col(m, k), s, lambda k: jnp.sum(jnp.where(iw == k, bv, 0.0)), hc=hc,
                                   iters=st.iters, eps=st.eps)
    plt.store(mix_out.at[pl.ds(r0, st.bn), pl.ds(z, WIDTH)], _place(pre + post + comb, WIDTH),
              mask=ok & (_cols(WIDTH) < mw))


def _normalise(st: _Static, rb, d_start, n_cols, layer, rx, x_src, norm_ref, x_out, xq_out, uncached):
    """x = norm_w * (x_src * rx) rounded to bf16 (and its FP8 qdq) over columns d_start .. + n_cols, in steps of
    `_norm_step` columns, unrolled when there are at most MAX_UNROLL (their loads overlap; a loop waits for each).
    With fewer rows than a block (N < bn: one block, N valid rows) each valid row is normalised alone in [1, w]
    tiles: a [bn, w] tile would spend bn / N times the ALU work on masked rows (at N = 1, 16x; in the one-launch
    form one program does all of D)."""
    r0, ok = _rows(st, rb)
    if st.N < st.bn:
        ib = jax.lax.broadcasted_iota(jnp.int32, (st.bn,), 0)
        tiles = [(r0 + r, 1, jnp.sum(jnp.where(ib == r, rx, 0.0)).reshape(1), None) for r in range(st.N)]
    else:
        tiles = [(r0, st.bn, rx, ok)]
    w_step = _norm_step(st, n_cols, tiles[0][1])

    def step(d0, rs, nr, rxv, mask):
        fill = {} if mask is None else {"mask": mask, "other": 0.0}  # Triton takes `other` only with a mask
        xv = load_uncached(x_src.at[pl.ds(rs, nr), pl.ds(d0, w_step)], l2_only=uncached, **fill)
        w = plt.load(norm_ref.at[layer, pl.ds(d0, w_step)]).astype(F32)
        xn = (w[None, :] * (xv.astype(F32) * rxv[:, None])).astype(BF16)
        plt.store(x_out.at[pl.ds(rs, nr), pl.ds(d0, w_step)], xn, mask=mask)
        if st.quantize:
            plt.store(xq_out.at[pl.ds(rs, nr), pl.ds(d0, w_step)], fp8_qdq_block(xn.astype(F32)).astype(BF16),
                      mask=mask)

    n_steps = n_cols // w_step
    for tile in tiles:
        if n_steps * len(tiles) <= MAX_UNROLL:
            for t in range(n_steps):
                step(d_start + t * w_step, *tile)
        else:
            jax.lax.fori_loop(0, n_steps, lambda t, c, tile=tile: (step(d_start + t * w_step, *tile), c)[1], 0)


def _norm_step(st: _Static, n_cols: int, rows: int) -> int:
    """Columns per normalisation step: the widest power of two dividing n_cols with rows * width <= NORM_TILE."""
    w = max(st.bk, NORM_TILE // rows)
    while w > 32 and n_cols % w:
        w //= 2
    return min(w, n_cols)


def _rx(st: _Static, acc):
    return jax.lax.rsqrt(_col(acc, COL_SSX) / st.D + st.norm_eps)


def _fused_kernel(layer_ref, y_ref, h_ref, mix_ref, fn_ref, scale_ref, base_ref, norm_ref, cnt_in,
                  *outs, st: _Static):
    del cnt_in  # aliased to the counter output
    h_out, x_out, mix_out, part, cnt = outs[:5]
    xq_out = outs[5] if st.quantize else None
    rb, dc = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    _phase1(st, rb, dc, layer, y_ref, h_ref, mix_ref, fn_ref, h_out, x_out, part)
    @pl.when(last_arrival(cnt, rb, st.n_dc, st.interpret))
    def _epilogue():
        acc = _partials(st, rb, part)
        _mixes(st, rb, layer, acc, scale_ref, base_ref, mix_out)
        _normalise(st, rb, 0, st.D, layer, _rx(st, acc), x_out, norm_ref, x_out, xq_out, True)


def _phase1_kernel(layer_ref, y_ref, h_ref, mix_ref, fn_ref, h_out, xun_out, part, *, st: _Static):
    _phase1(st, pl.program_id(0), pl.program_id(1), layer_ref[0], y_ref, h_ref, mix_ref, fn_ref, h_out, xun_out,
            part)


def _phase2_kernel(layer_ref, part, xun, scale_ref, base_ref, norm_ref, *outs, st: _Static):
    x_out, mix_out = outs[:2]
    xq_out = outs[2] if st.quantize else None
    rb, dc = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    acc = _partials(st, rb, part)

    @pl.when(dc == 0)
    def _():
        _mixes(st, rb, layer, acc, scale_ref, base_ref, mix_out)

    _normalise(st, rb, dc * st.dk, st.dk, layer, _rx(st, acc), xun, norm_ref, x_out, xq_out, False)


@functools.partial(jax.jit, static_argnames=("st", "single_launch", "num_warps"))
def _call(layer, y, h, mix, fn, scale, base, norm_w, *, st: _Static, single_launch: bool, num_warps: int):
    N, D, hc = st.N, st.D, st.hc
    n_rb = pl.cdiv(N, st.bn)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    sds = jax.ShapeDtypeStruct
    mw = (2 + hc) * hc
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    grid = (n_rb, st.n_dc)
    h2 = h.reshape(N, hc * D)
    part_s = sds((st.n_dc, N, WIDTH), F32)
    xq_s = (sds((N, D), BF16),) if st.quantize else ()
    if single_launch:
        outs = pl.pallas_call(
            functools.partial(_fused_kernel, st=st), grid=grid, in_specs=[any_] * 9,
            out_shape=(sds((N, hc * D), BF16), sds((N, D), BF16), sds((N, mw), F32), part_s, sds((n_rb,), jnp.int32))
            + xq_s, out_specs=tuple([any_] * (5 + len(xq_s))), input_output_aliases={8: 4},
            compiler_params=params, interpret=st.interpret, name="mega_mhc")(
            layer, y, h2, mix, fn, scale, base, norm_w, jnp.zeros((n_rb,), jnp.int32))
        h_new, x, mix_new = outs[:3]
        xq = outs[5] if st.quantize else None
    else:
        h_new, xun, part = pl.pallas_call(
            functools.partial(_phase1_kernel, st=st), grid=grid, in_specs=[any_] * 5,
            out_shape=(sds((N, hc * D), BF16), sds((N, D), BF16), part_s), out_specs=(any_, any_, any_),
            compiler_params=params, interpret=st.interpret, name="mega_mhc_phase1")(
            layer, y, h2, mix, fn)
        outs = pl.pallas_call(
            functools.partial(_phase2_kernel, st=st), grid=grid, in_specs=[any_] * 6,
            out_shape=(sds((N, D), BF16), sds((N, mw), F32)) + xq_s, out_specs=tuple([any_] * (2 + len(xq_s))),
            compiler_params=params, interpret=st.interpret, name="mega_mhc_phase2")(
            layer, part, xun, scale, base, norm_w)
        x, mix_new = outs[:2]
        xq = outs[2] if st.quantize else None
    return h_new.reshape(N, hc, D), x, xq, mix_new


def hc_boundary(y, h, mix, fn, scale, base, norm_w, *, layer=None, hc: int, iters: int, eps: float,
                norm_eps: float, quantize: bool, single_launch: bool = False, blocks: MhcBlocks | None = None,
                interpret: bool | None = None):
    """One mHC sublayer boundary (module docstring).

    y [N, D] bf16; h [N, hc, D] bf16; mix [N, (2+hc)*hc] f32; fn [(L,) (2+hc)*hc, hc*D] f32;
    scale [(L,) 3]; base [(L,) (2+hc)*hc]; norm_w [(L,) D]; layer: the int32 layer index of stacked weights
    (read in-kernel; None: unstacked). Returns (h' [N, hc, D] bf16, x [N, D] bf16, xq [N, D] bf16 or None,
    mix' [N, (2+hc)*hc] f32)."""
    N, D = y.shape
    mw = (2 + hc) * hc
    if mw > WIDTH - 2 or hc & (hc - 1):
        raise ValueError(f"hc={hc}: the kernel holds (2+hc)*hc <= {WIDTH - 2} logits and needs hc a power of two")
    if h.shape != (N, hc, D) or mix.shape != (N, mw):
        raise ValueError(f"mega_mhc: shapes y {y.shape} h {h.shape} mix {mix.shape}")
    stacked = fn.ndim == 3
    if stacked != (layer is not None):
        raise ValueError("mega_mhc: stacked weights need `layer` (and unstacked ones none)")
    if not stacked:
        fn, scale, base, norm_w = fn[None], scale[None], base[None], norm_w[None]
    b = blocks or pick_blocks(N, D)
    if D % b.dk or D % 32 or b.dk & (b.dk - 1) or b.bn < 16 or b.bn & (b.bn - 1):
        raise ValueError(f"mega_mhc: D={D} with blocks {b} (power-of-two blocks, bn >= 16, dk | D)")
    interpret = interpret_default() if interpret is None else interpret
    st = _Static(N=N, D=D, hc=hc, bn=b.bn, dk=b.dk, bk=min(b.dk, 4096 // b.bn), n_dc=D // b.dk, iters=iters,
                 eps=float(eps), norm_eps=float(norm_eps), quantize=quantize, interpret=interpret,
                 warps=b.num_warps)
    lay = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    return _call(lay, y.astype(BF16), h.astype(BF16), mix.astype(F32), fn, scale, base, norm_w,
                 st=st, single_launch=single_launch, num_warps=b.num_warps)
