"""Fused training attention of one fresh CSA2 chunk (flash-attention style): Pallas Triton forward and backward
kernels behind one `jax.custom_vjp`. Its one jnp reference is dsv41_jax.train_attention.blocked_attention (the
"blocked" training form; the tests' oracle): this computes the same quantity without materialising any score
tensor in HBM.

Semantics (per sequence b, query row t in [0, T), heads h < H; MQA: keys = values, one vector shared by all
heads). Two key sets share ONE softmax together with a per-head sink logit sink[h] (in the denominator as
exp(sink - m), nothing in the numerator):
- the band: chunk_kv[b, j] for t - W < j <= t, j >= 0 and pos0[b] + j >= clip[b];
- the latents (when lat is given): lat[b, c] iff c is among sel[b, t, :] (ids distinct; -1 or >= C = none).
s = (q . k) * scale with f32 accumulation (operands in q's dtype; f32 dots at IEEE precision, never TF32);
m = max(visible scores, sink); den = sum(exp(s - m)) + exp(sink - m) in f32; num = sum(p * v) with p rounded to
q's dtype when `round_p` (the bf16 config) before the P.V product; out = num / den in q's dtype. A row with no
visible key outputs 0. The kernels run an online softmax (running max started at the sink, whose exp(0) = 1
opens the denominator), so in a bf16 config P is rounded against the running max instead of the row's final
max: the outputs differ from the reference by bf16 rounding only (f32: by f32 summation order).

Gradients (custom_vjp; every input that is a float: q, chunk_kv, lat, sink): the backward recomputes
P = exp(s - lse) from the forward's per-row log-sum-exp lse = m + log(den) (the sink included), with
delta = rowsum(dout * out) (XLA):  dS = P * (dout . v - delta);  dq = scale * dS k;  dk = scale * dS^T q;
dv = P^T dout (k = v, so d(chunk_kv) / d(lat) = dk + dv, summed over all heads and all rows that see the key);
d(sink[h]) = -sum over rows of delta * exp(sink[h] - lse) (XLA, from the saved lse).

Kernel layout. Query rows are processed as "row vectors" r = t * Hp + h (all heads of BQ consecutive positions:
rows = BQ * Hp vectors of one program (ROWS with latents, ROWS_SWA for an SWA-only layer; Hp = H padded to a
power of two), so each key block is loaded once for all heads (MQA). Key blocks have BK entries.
- forward (grid B x T/BQ): the band key blocks that can be visible to the program's positions
  [i*BQ - W + 1, i*BQ + BQ - 1], then the latent blocks that at least one of its rows selected (a compacted list
  built in XLA from the selection bitmask: a block no row of the program selected is skipped), masked by the
  bitmask. Writes out and lse.
- dq (grid B x T/BQ): the same loops, recomputing P and dS; writes dq.
- d(chunk_kv) (grid B x T/BK): key block kb loops over the query blocks that can see it ([kb*BK, kb*BK + BK - 1 +
  W - 1]); d(lat) (grid B x C/BK): latent block cb loops over the query blocks that selected any of its entries
  (the transposed compacted list). Both work on transposed scores [BK, rows].
The latent mask is a bitmask [B, T, C/32] int32 (bit c % 32 of word c // 32: entry c is selected), built by one
XLA scatter-add of the selected ids (ids distinct, so the add is an or); the kernels read it with a gather of
one word per (position, key), broadcast over the heads in registers (MASK_PER_POSITION; 1.7x faster on the
H200 than one load per (row vector, key)).

Invariants and requirements: ids in sel are distinct per row (as blocked_attention requires); shapes are padded
in the wrapper (T to a multiple of max(BQ, BK) with zero rows, C to a multiple of BK with zero latents, d to a
power of two >= 16 with zero columns, H to a power of two with zero queries and sink 0): padded rows, columns,
heads and latents are never visible to a real row, and their gradient contributions are exactly zero (their
dout is zero) or sliced away. H <= rows. Every output element of every kernel is written (the tests poison them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common

F32 = jnp.float32
I32 = jnp.int32
# query row vectors (positions x padded heads) of one program: with latents / SWA-only (H200, H = 4, d = 64,
# bf16: 64 is ~8% faster than 128 with latents, 128 ~30% faster than 64 without; bench/train_attention.py)
ROWS = 64
ROWS_SWA = 128
BK = 64  # keys (band entries or latents) per step
NUM_WARPS = 4
NUM_STAGES = 2
# the latent mask is read once per (position, latent) and broadcast over the heads in registers (True), or read
# once per (row vector, latent) (False: H times the loads, all L1 hits, no reshape)
MASK_PER_POSITION = True


@dataclass(frozen=True)
class _Static:
    T: int  # padded positions
    rows: int  # query row vectors of one program (ROWS or ROWS_SWA)
    Hp: int  # padded heads (power of two)
    d: int  # padded head dim (power of two)
    W: int
    C: int  # padded latents (0: none)
    scale: float
    round_p: bool
    f32: bool  # f32 operands: IEEE dots
    interpret: bool

    @property
    def BQ(self):  # positions per program
        return self.rows // self.Hp

    @property
    def nQ(self):
        return self.T // self.BQ

    @property
    def shift(self):  # log2(Hp): row vector r is position r >> shift, head r & (Hp - 1)
        return self.Hp.bit_length() - 1

    @property
    def words(self):
        return max(self.C // 32, 1)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _iota(n, dim=0, shape=None):
    return jax.lax.broadcasted_iota(I32, shape or (n,), dim)


def _dot(st, a, b, trans_b=False):
    return plt.dot(a, b, trans_b=trans_b, precision=jax.lax.Precision.HIGHEST if st.f32 else None)


# ----------------------------------------------------------------------------- masks
def _band_ok(st, t, j, pos0, clip):
    """t, j: broadcastable int32 position / band-entry arrays -> visibility (the window, the replay clip)."""
    return (j <= t) & (j > t - st.W) & (pos0 + j >= clip)


def _lat_ok(st, words_ref, b, t, c):
    """t, c: int32 arrays of one shape -> whether row t selected latent c (bit c % 32 of words[b, t, c // 32])."""
    w = plt.load(words_ref.at[b, t, c >> 5])
    return ((w >> (c & 31)) & 1) != 0


def _lat_ok_rows(st, words_ref, b, q0, c0):
    """Latent mask [rows, BK] of the program's row vectors (positions q0 + r // Hp) x latents c0 + [0, BK)."""
    if not MASK_PER_POSITION:
        t = q0 + (_iota(st.rows, 0, (st.rows, BK)) >> st.shift)
        return _lat_ok(st, words_ref, b, t, c0 + _iota(BK, 1, (st.rows, BK)))
    ok = _lat_ok(st, words_ref, b, q0 + _iota(st.BQ, 0, (st.BQ, BK)), c0 + _iota(BK, 1, (st.BQ, BK)))
    return jnp.broadcast_to(ok[:, None, :], (st.BQ, st.Hp, BK)).reshape(st.rows, BK)


def _lat_ok_cols(st, words_ref, b, q0, c0):
    """Transposed latent mask [BK, rows]: latents c0 + [0, BK) x row vectors (positions q0 + r // Hp)."""
    if not MASK_PER_POSITION:
        t = q0 + (_iota(st.rows, 1, (BK, st.rows)) >> st.shift)
        return _lat_ok(st, words_ref, b, t, c0 + _iota(BK, 0, (BK, st.rows)))
    ok = _lat_ok(st, words_ref, b, q0 + _iota(st.BQ, 1, (BK, st.BQ)), c0 + _iota(BK, 0, (BK, st.BQ)))
    return jnp.broadcast_to(ok[:, :, None], (BK, st.BQ, st.Hp)).reshape(BK, st.rows)


def _band_range(st, q0, nq):
    """Key blocks that can hold band entries visible to positions [q0, q0 + nq)."""
    return jnp.maximum(q0 - st.W + 1, 0) // BK, (q0 + nq - 1) // BK + 1


def _walk_keys(st, b, i, kv_ref, lat_refs, pos0, clip, update, carry):
    """Fold `update(carry, k [BK, d], ok [rows, BK])` over the key blocks visible to query block i of sequence b:
    the band blocks of its window, then (with latents) the latent blocks its rows selected (compacted list)."""
    t_col = i * st.BQ + (_iota(st.rows, 0, (st.rows, BK)) >> st.shift)  # [rows, BK] position of each row vector

    def band(kb, carry):
        k = kv_ref[b, pl.ds(kb * BK, BK), :]
        return update(carry, k, _band_ok(st, t_col, kb * BK + _iota(BK, 1, (st.rows, BK)), pos0, clip))

    lo, hi = _band_range(st, i * st.BQ, st.BQ)
    carry = jax.lax.fori_loop(lo, hi, band, carry)
    if not st.C:
        return carry
    lat_ref, words_ref, lst_ref, cnt_ref = lat_refs

    def latents(n, carry):
        cb = lst_ref[b, i, n]
        k = lat_ref[b, pl.ds(cb * BK, BK), :]
        return update(carry, k, _lat_ok_rows(st, words_ref, b, i * st.BQ, cb * BK))

    return jax.lax.fori_loop(0, cnt_ref[b, i], latents, carry)


# ----------------------------------------------------------------------------- forward
def _fwd_kernel(pos0_ref, clip_ref, q_ref, sink_ref, kv_ref, *rest, st: _Static):
    lat_refs, (o_ref, lse_ref) = rest[:-2], rest[-2:]
    b, i = pl.program_id(0), pl.program_id(1)
    q = q_ref[...]  # [rows, d]
    sink = sink_ref[...]  # [rows] f32 (per row vector)

    def update(carry, k, ok):
        m, l, acc = carry
        s = jnp.where(ok, _dot(st, q, k, trans_b=True) * st.scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        corr = jnp.exp(m - m_new)
        pv = p.astype(k.dtype) if st.round_p else p
        return m_new, l * corr + jnp.sum(p, axis=1), acc * corr[:, None] + _dot(st, pv.astype(k.dtype), k)

    # the running max starts at the sink, whose exp(0) = 1 opens the denominator
    carry = (sink, jnp.ones((st.rows,), F32), jnp.zeros((st.rows, st.d), F32))
    m, l, acc = _walk_keys(st, b, i, kv_ref, lat_refs, pos0_ref[b], clip_ref[b], update, carry)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


# ----------------------------------------------------------------------------- backward: dq
def _dq_kernel(pos0_ref, clip_ref, q_ref, do_ref, lse_ref, delta_ref, kv_ref, *rest, st: _Static):
    lat_refs, dq_ref = rest[:-1], rest[-1]
    b, i = pl.program_id(0), pl.program_id(1)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def update(dq, k, ok):
        s = _dot(st, q, k, trans_b=True) * st.scale
        p = jnp.where(ok, jnp.exp(s - lse[:, None]), 0.0)
        ds = p * (_dot(st, do, k, trans_b=True) - delta[:, None])
        return dq + _dot(st, ds.astype(k.dtype), k)

    dq = _walk_keys(st, b, i, kv_ref, lat_refs, pos0_ref[b], clip_ref[b], update, jnp.zeros((st.rows, st.d), F32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


# ----------------------------------------------------------------------------- backward: dk + dv
def _dkv_step(st, acc, k, qb, b, q_ref, do_ref, lse_ref, delta_ref, ok):
    """Key block k [BK, d] against query block qb (transposed scores [BK, rows], visibility ok [BK, rows]):
    acc += (dS^T q, P^T do) (the caller scales the first by `scale`)."""
    dk, dv = acc
    r0 = qb * st.rows
    q = q_ref[b, pl.ds(r0, st.rows), :]
    do = do_ref[b, pl.ds(r0, st.rows), :]
    lse = lse_ref[b, pl.ds(r0, st.rows)]
    delta = delta_ref[b, pl.ds(r0, st.rows)]
    s = _dot(st, k, q, trans_b=True) * st.scale
    p = jnp.where(ok, jnp.exp(s - lse[None, :]), 0.0)
    ds = p * (_dot(st, k, do, trans_b=True) - delta[None, :])
    pv = p.astype(k.dtype) if st.round_p else p
    return dk + _dot(st, ds.astype(k.dtype), q), dv + _dot(st, pv.astype(k.dtype), do)


def _dkv_kernel(pos0_ref, clip_ref, q_ref, do_ref, lse_ref, delta_ref, kv_ref, dkv_ref, *, st: _Static):
    b, kb = pl.program_id(0), pl.program_id(1)
    pos0, clip = pos0_ref[b], clip_ref[b]
    k = kv_ref[...]  # [BK, d]
    j = kb * BK + _iota(BK, 0, (BK, st.rows))

    def body(qb, acc):
        t = qb * st.BQ + (_iota(st.rows, 1, (BK, st.rows)) >> st.shift)  # [BK, rows]
        return _dkv_step(st, acc, k, qb, b, q_ref, do_ref, lse_ref, delta_ref, _band_ok(st, t, j, pos0, clip))

    qlo = kb * BK // st.BQ
    qhi = jnp.minimum((kb * BK + BK - 1 + st.W - 1) // st.BQ + 1, st.nQ)
    zero = jnp.zeros((BK, st.d), F32)
    dk, dv = jax.lax.fori_loop(qlo, qhi, body, (zero, zero))
    dkv_ref[...] = (dk * st.scale + dv).astype(dkv_ref.dtype)


def _dlat_kernel(q_ref, do_ref, lse_ref, delta_ref, lat_ref, words_ref, lst_ref, cnt_ref, dlat_ref, *,
                 st: _Static):
    b, cb = pl.program_id(0), pl.program_id(1)
    k = lat_ref[...]

    def body(n, acc):
        qb = lst_ref[b, cb, n]
        return _dkv_step(st, acc, k, qb, b, q_ref, do_ref, lse_ref, delta_ref,
                         _lat_ok_cols(st, words_ref, b, qb * st.BQ, cb * BK))

    zero = jnp.zeros((BK, st.d), F32)
    dk, dv = jax.lax.fori_loop(0, cnt_ref[b, cb], body, (zero, zero))
    dlat_ref[...] = (dk * st.scale + dv).astype(dlat_ref.dtype)


# ----------------------------------------------------------------------------- launches
ANY = pl.BlockSpec(memory_space=pl.ANY)


def _launch(st, kernel, name, grid, inputs, in_specs, outs, poison):
    """pallas_call of `kernel` (partial'd with st); outs: [(ShapeDtypeStruct, BlockSpec)]. poison (tests): each
    output starts as a NaN buffer aliased into the call, so an element the kernel does not write stays NaN."""
    kernel = functools.partial(kernel, st=st)
    aliases = {}
    if poison:
        n_in = len(inputs)
        inputs = [*inputs, *(jnp.full(s.shape, jnp.nan, s.dtype) for s, _ in outs)]
        in_specs = [*in_specs, *(spec for _, spec in outs)]
        aliases = {n_in + k: k for k in range(len(outs))}
        kernel = functools.partial(_drop_aliased, kernel, len(outs))
    return pl.pallas_call(
        kernel, out_shape=[s for s, _ in outs], grid=grid, in_specs=in_specs, out_specs=[sp for _, sp in outs],
        input_output_aliases=aliases, interpret=st.interpret, name=name,
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES))(*inputs)


def _drop_aliased(kernel, n: int, *refs):
    """Kernel wrapper that ignores the n aliased inputs (the n outputs follow them)."""
    return kernel(*refs[: len(refs) - 2 * n], *refs[len(refs) - n:])


def _row_spec(st):
    return pl.BlockSpec((None, st.rows, st.d), lambda b, i: (b, i, 0))


def _vec_spec(st):
    return pl.BlockSpec((None, st.rows), lambda b, i: (b, i))


def _lat_args(st, lat, ints):
    return ([lat, ints["words"], ints["qlat"], ints["qcnt"]] if st.C else []), ([ANY] * 4 if st.C else [])


def _fwd(st, q, kv, lat, sink_rows, ints, poison):
    B = q.shape[0]
    la, ls = _lat_args(st, lat, ints)
    out = [(jax.ShapeDtypeStruct(q.shape, q.dtype), _row_spec(st)),
           (jax.ShapeDtypeStruct(q.shape[:2], F32), _vec_spec(st))]
    return _launch(st, _fwd_kernel, "flash_train_attention_fwd", (B, st.nQ),
                   [ints["pos0"], ints["clip"], q, sink_rows, kv, *la],
                   [ANY, ANY, _row_spec(st), pl.BlockSpec((st.rows,), lambda b, i: (0,)), ANY, *ls], out, poison)


def _bwd(st, q, kv, lat, do, lse, delta, ints, poison):
    B = q.shape[0]
    la, ls = _lat_args(st, lat, ints)
    (dq,) = _launch(st, _dq_kernel, "flash_train_attention_dq", (B, st.nQ),
                    [ints["pos0"], ints["clip"], q, do, lse, delta, kv, *la],
                    [ANY, ANY, _row_spec(st), _row_spec(st), _vec_spec(st), _vec_spec(st), ANY, *ls],
                    [(jax.ShapeDtypeStruct(q.shape, q.dtype), _row_spec(st))], poison)
    key_spec = pl.BlockSpec((None, BK, st.d), lambda b, k: (b, k, 0))
    (dkv,) = _launch(st, _dkv_kernel, "flash_train_attention_dkv", (B, st.T // BK),
                     [ints["pos0"], ints["clip"], q, do, lse, delta, kv], [ANY] * 6 + [key_spec],
                     [(jax.ShapeDtypeStruct(kv.shape, kv.dtype), key_spec)], poison)
    dlat = None
    if st.C:
        (dlat,) = _launch(st, _dlat_kernel, "flash_train_attention_dlat", (B, st.C // BK),
                          [q, do, lse, delta, lat, ints["words"], ints["lat_q"], ints["lat_qcnt"]],
                          [ANY] * 4 + [key_spec] + [ANY] * 3,
                          [(jax.ShapeDtypeStruct(lat.shape, lat.dtype), key_spec)], poison)
    return dq, dkv, dlat


# ----------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _attention(st, q, kv, lat, sink, ints, poison):
    return _forward(st, q, kv, lat, sink, ints, poison)[0]


def _sink_rows(st, sink):
    return jnp.tile(sink, st.BQ)  # [rows]: row vector r has head r % Hp


def _forward(st, q, kv, lat, sink, ints, poison):
    return _fwd(st, q, kv, lat, _sink_rows(st, sink), ints, poison)


def _attention_fwd(st, q, kv, lat, sink, ints, poison):
    o, lse = _forward(st, q, kv, lat, sink, ints, poison)
    return o, (q, kv, lat, sink, ints, o, lse)


def _attention_bwd(st, poison, res, do):
    q, kv, lat, sink, ints, o, lse = res
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)  # [B, T * Hp]
    dq, dkv, dlat = _bwd(st, q, kv, lat, do.astype(q.dtype), lse, delta, ints, poison)
    B = q.shape[0]
    p_sink = jnp.exp(sink[None, None, :] - lse.reshape(B, st.T, st.Hp))
    dsink = -jnp.sum(delta.reshape(B, st.T, st.Hp) * p_sink, axis=(0, 1))
    return dq, dkv, dlat, dsink, jax.tree.map(lambda _: None, ints)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- wrapper
def _block_lists(flags):
    """flags [B, X, Y] bool -> (ids [B, X, Y] int32: the y with flags set first, in order; counts [B, X])."""
    ids = jnp.argsort(~flags, axis=-1, stable=True).astype(I32)
    return ids, jnp.sum(flags, axis=-1, dtype=I32)


def selection_bitmask(sel, C: int, T: int):
    """sel [B, T0, k] (ids distinct per row; < 0 or >= C: none) -> [B, T, C / 32] int32 bitmask (rows >= T0 empty;
    C a multiple of 32)."""
    B, T0, _ = sel.shape
    ok = (sel >= 0) & (sel < C)
    word = jnp.where(ok, sel >> 5, C // 32)  # out of range: dropped
    bit = jnp.left_shift(jnp.int32(1), sel & 31)
    bi = jnp.arange(B, dtype=I32)[:, None, None]
    ti = jnp.arange(T0, dtype=I32)[None, :, None]
    return jnp.zeros((B, T, C // 32), I32).at[bi, ti, word].add(bit, mode="drop")


def flash_train_attention(q, chunk_kv, lat, sel, sink, pos0, clip, *, window: int, scale: float, round_p: bool,
                          interpret=None, _poison_out: bool = False):
    """The fused training attention (module docstring): q [B,T,H,d], chunk_kv [B,T,d], lat [B,C,d] or None (an
    SWA-only layer; sel ignored), sel [B,T,k] int (-1 = none), sink [H] f32, pos0 / clip [B] int -> [B,T,H,d] in
    q's dtype. chunk_kv and lat must have q's dtype. Differentiable in q, chunk_kv, lat and sink.
    _poison_out (tests): every kernel output starts as a NaN buffer, so an unwritten element shows."""
    interpret = common.interpret_default() if interpret is None else interpret
    B, T0, H, d0 = q.shape
    C = 0 if lat is None or lat.shape[1] == 0 else -(-lat.shape[1] // BK) * BK
    rows = ROWS if C else ROWS_SWA
    if H > rows:
        raise ValueError(f"{H} heads > {rows} row vectors per program")
    if chunk_kv.dtype != q.dtype or (lat is not None and lat.dtype != q.dtype):
        raise ValueError("chunk_kv / lat must have q's dtype")
    Hp, d = _pow2(H), max(_pow2(d0), 16)
    blk = max(rows // Hp, BK)
    T = -(-T0 // blk) * blk
    st = _Static(T=T, rows=rows, Hp=Hp, d=d, W=int(window), C=C, scale=float(scale), round_p=bool(round_p),
                 f32=q.dtype == F32, interpret=interpret)
    qp = jnp.pad(q, [(0, 0), (0, T - T0), (0, Hp - H), (0, d - d0)]).reshape(B, T * Hp, d)
    kvp = jnp.pad(chunk_kv, [(0, 0), (0, T - T0), (0, d - d0)])
    ints = {"pos0": pos0.astype(I32), "clip": clip.astype(I32)}
    latp = None
    if C:
        latp = jnp.pad(lat, [(0, 0), (0, C - lat.shape[1]), (0, d - d0)])
        sel = jnp.where(sel < lat.shape[1], sel, -1).astype(I32)  # ids of padded latents: none
        words = selection_bitmask(sel, C, T)  # [B, T, C/32]
        nw = BK // 32
        hit = jnp.any(words.reshape(B, st.nQ, st.BQ, C // BK, nw) != 0, axis=(2, 4))  # [B, nQ, C/BK]
        ints["words"] = words
        ints["qlat"], ints["qcnt"] = _block_lists(hit)  # per query block: the latent blocks it selects
        ints["lat_q"], ints["lat_qcnt"] = _block_lists(jnp.swapaxes(hit, 1, 2))  # per latent block: its queries
    sinkp = jnp.pad(sink.astype(F32), (0, Hp - H))
    o = _attention(st, qp, kvp, latp, sinkp, ints, _poison_out)
    return o.reshape(B, T, Hp, d)[:, :T0, :H, :d0]
