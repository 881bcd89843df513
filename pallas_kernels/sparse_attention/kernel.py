"""Paged sparse attention of one DeepSeek-V4.1 CSA2 layer (docs/ARCHITECTURE.md): a Pallas Triton kernel and
its wrapper. Its one jnp reference is the model's: dsv41_jax.attention.sparse_attention over the keys gathered
by the ops seam's XLA branch (the tests' oracle). Operands arrive as one `SparseAttentionOperands` pytree and
the KV storage as `PagedAttentionKV` (operands.py), whose page size and entry size are the caller's layout
(static fields).

Per query row (b, i) at position t = pos0[b] + i, H query heads of dim d attend (MQA, K = V = one latent) over
the key list [window (W entries, oldest first), selected compressed entries (k)] plus an attention sink:
- window entry w is position p = t - W + 1 + w, valid iff p >= 0 and p >= clip[b]; its value is
  chunk_kv[b, p - pos0[b]] when p >= pos0[b], else the FP8 ring entry ring[layer, ring_slot[b], p % W]
  (d E4M3 bytes, then d/32 UE8M0 scale bytes);
- selected entry j is e = sel[b, i, j] (-1 = none): d/2 packed E2M1 bytes (low nibble = even element) and
  d/16 E4M3 scale bytes at pages[page_table[b, e // n], region + (e % n) * eb], n = page_tokens // ratio,
  eb = entry_bytes (must be d/2 + d/16: the only format the decoder reads).
Masked entries never contribute, whatever their bytes hold (0xFF-poisoned pages, stale ring slots): their loads
are masked (they read nothing and yield 0) and their scores are selected to -inf before the softmax.

Numerics (the official kernel's, as dsv41_jax.attention.sparse_attention emulates): s = (q . k in f32) * scale;
softmax online over consecutive 64-entry chunks of the key list with a cumulative running max floored at
-1e30; unnormalised probabilities exp(s - running_max) are rounded to bf16 before P.V; the denominator adds
exp(sink_h - final_max). o = numerator / denominator, cast to bf16. With `freqs` (the layer's RoPE frequencies)
o then leaves with the model's inverse RoPE at the row's position (dsv41_jax.rope.apply_rope(inverse=True): the
last 2 * len(freqs) channels, interleaved pairs, rotated in f32 from the bf16 o, cast back), in the kernel's
epilogue (one split) or after the XLA merge of the splits; the rotation's cos / sin may differ from XLA's by an
f32 ulp (one bf16 ulp of o, rarely).

Contract (against the reference above):
- The kernel decodes the keys exactly (every key is exact in bf16: an E2M1 value times an E4M3 scale has <= 6
  significant bits, an E4M3 value times a power of two <= 4; masking is exact too); it differs from the
  reference only by the f32
  summation order of the dots (q.k is two half-dim dots, even and odd elements) and, with num_splits > 1, by
  the merge: each split restarts the running max, so its bf16 rounding of the probabilities differs.
  Measured (interpret mode, random inputs, also at the full shape): every output element is within 1 bf16 ulp
  of max|ref| over its row's heads; one split: >= 99.99% of elements bit-identical; 2..10 splits: 78-94%
  bit-identical, per-element error at the 99th percentile 3-7 ulps of the element itself.

Kernel layout: grid (B*T rows, H / block_h head blocks, num_splits); see block_sizes.py for the trade-offs.
Row r is sequence r // T at position pos0 + r % T (read in-kernel from the operands: no table built in XLA); a
program splits its q block into even/odd element planes (tt.split) and loops over its 64-key
chunks (window chunks that cannot hold chunk_kv rows, the chunk(s) that can, then selected chunks), decodes
each chunk into bf16 even/odd planes [64, d/2] and runs QK^T and PV as two plt.dot pairs; the output planes
are re-joined in-kernel (tt.join). With splits, each split stores its (acc, max, sum) partials and the split
of a (row, head block) that arrives last (pallas_kernels.common.last_arrival) merges them in order and writes
the output: one launch (plus the counters' memset) whatever the split count. Decoding (`decode="cvt"`,
default): E2M1 nibbles are moved into E4M3 bit positions (the value times 2^-6) and converted by the hardware
E4M3 conversion, scales are applied per 16/32-element group by a 3-D broadcast, all in bf16 (exact);
`decode="int"` uses the integer decoders of pallas_kernels.common instead (also exact; about 1.6x the
instructions). Pools are raw HBM refs
(memory_space=ANY) indexed in-kernel, never sliced outside; the Pallas lowering switches to 64-bit offsets only
for pools over 4 GiB (a pool between 2 and 4 GiB would need a check of its 32-bit offset arithmetic).
Requirements: W % 64 == 0; d a power of two >= 32; region % 16 == 0 (an alignment hint for vector loads).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.sparse_attention.block_sizes import BlockSizes, ResolvedBlockSizes
from pallas_kernels.sparse_attention.operands import PagedAttentionKV, SparseAttentionOperands

F32 = jnp.float32
BF16 = jnp.bfloat16
CHUNK = 64  # softmax chunk of the official kernel = keys per kernel step
NEG_INF = float("-inf")
MAX_FLOOR = -1e30


# ----------------------------------------------------------------------------- byte decoders
def _e4m3(byte, decode: str, dtype=F32):
    """E4M3 bytes -> values (exact in f32 and bf16; NaN for 0x7f/0xff)."""
    if decode == "int":
        return common.e4m3_to_f32(byte).astype(dtype)
    return jax.lax.bitcast_convert_type(byte, jnp.float8_e4m3fn).astype(dtype)


def _fp4_planes(packed, decode: str, dtype=F32):
    """Packed E2M1 bytes (uint8) -> (even, odd) element values, times FP4_CVT_FACTOR[decode]**-1."""
    if decode == "int":
        return (common.e2m1_to_f32(common.low_nibble(packed)).astype(dtype),
                common.e2m1_to_f32(common.high_nibble(packed)).astype(dtype))
    # E2M1 code s.e1e0.m -> E4M3 byte s.000e1e0.m00: the same value times 2^-6 (E2M1 e=0 is E4M3-subnormal)
    lo = ((packed & 7) << 2) | ((packed & 8) << 4)
    hi = ((packed >> 2) & 0x1C) | (packed & 0x80)
    return _e4m3(lo, "cvt", dtype), _e4m3(hi, "cvt", dtype)


FP4_CVT_FACTOR = {"cvt": 64.0, "int": 1.0}


def _scalar(x):
    return jnp.asarray(x, jnp.int32).reshape(())


# ----------------------------------------------------------------------------- kernel
@dataclass(frozen=True)
class _Static:
    d: int
    W: int
    T: int
    n_win: int  # window chunks
    n_chunks: int  # window + selected chunks
    per: int  # chunks per split
    splits: int
    bh: int
    n: int  # entries per page
    eb: int  # latent entry bytes
    max_pages: int
    scale: float
    decode: str
    align: int  # power of two dividing every selected entry's byte offset
    has_sel: bool
    rope: int = 0  # len(freqs): inverse RoPE on the last 2 * rope channels (0: none)
    R: int = 1  # ring-pool rows per layer
    n_hb: int = 1  # head blocks
    interpret: bool = False
    out_bf16: bool = True  # the output dtype is bf16 (else f32)


def _iota(n):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _bcast(x, shape):
    """[n] -> [n, m] (x along rows)."""
    return jnp.broadcast_to(x[:, None], shape)


def _planes(x):
    """[.., d] -> (even, odd) [.., d/2] (tt.split)."""
    return jax.lax.unstack(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), axis=-1)


def _interleave(e, o):
    return jax.lax.stack([e, o], axis=-1).reshape(*e.shape[:-1], 2 * e.shape[-1])


def _step(st: _Static, carry, q_e, q_o, k_e, k_o, valid):
    """One 64-key chunk of the online softmax (cumulative max, bf16 probabilities); keys as bf16 even/odd
    element planes [64, d/2]."""
    m, l, acc_e, acc_o = carry
    s = plt.dot(q_e, k_e, trans_b=True) + plt.dot(q_o, k_o, trans_b=True)  # [bh, 64] f32
    s = jnp.where(valid[None, :], s * st.scale, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=1)
    pb = p.astype(BF16)
    acc_e = acc_e * corr[:, None] + plt.dot(pb, k_e)
    acc_o = acc_o * corr[:, None] + plt.dot(pb, k_o)
    return m_new, l, acc_e, acc_o


def _scaled(v, scl, group: int):
    """v [64, m] times a per-`group` scale scl [64, m / group] (3-D broadcast, no gathers), in bf16: every
    product is exact in bf16 (<= 6 significant bits for FP4 x E4M3, <= 4 for E4M3 x 2^k)."""
    rows, m = v.shape
    return (v.reshape(rows, m // group, group) * scl[:, :, None]).reshape(rows, m)


def _window_keys(st: _Static, c, b, t, pos0, clip, rrow, ckv_ref, ring_ref, with_chunk: bool):
    """Keys of window chunk c: bf16 planes [64, d/2] x 2 and validity [64]. Only chunks that may hold
    positions >= pos0 (with_chunk) also load chunk_kv rows (masked loads: a lane reads one source)."""
    d = st.d
    p = t - st.W + 1 + c * CHUNK + _iota(CHUNK)
    valid = (p >= 0) & (p >= clip)
    in_chunk = p >= pos0
    from_ring = valid & ~in_chunk if with_chunk else valid
    slot = jax.lax.rem(jnp.maximum(p, 0), st.W)
    cols = jnp.broadcast_to(_iota(d)[None, :], (CHUNK, d))  # (interpret mode rejects array + slice indexers)
    raw = plt.load(ring_ref.at[rrow, _bcast(slot, (CHUNK, d)), cols], mask=_bcast(from_ring, (CHUNK, d)), other=0)
    ns = d // 32
    scols = jnp.broadcast_to(d + _iota(ns)[None, :], (CHUNK, ns))
    sb = plt.load(ring_ref.at[rrow, _bcast(slot, (CHUNK, ns)), scols], mask=_bcast(from_ring, (CHUNK, ns)), other=0)
    scl = common.e8m0_to_f32(sb).astype(BF16)  # [64, d/32]: plane element i has scale i // 16
    r_e, r_o = _planes(raw)
    k_e = _scaled(_e4m3(r_e, st.decode, BF16), scl, 16)
    k_o = _scaled(_e4m3(r_o, st.decode, BF16), scl, 16)
    if with_chunk:
        crow = _bcast(jnp.clip(p - pos0, 0, st.T - 1), (CHUNK, d))
        ck = plt.load(ckv_ref.at[b, crow, cols], mask=_bcast(valid & in_chunk, (CHUNK, d)), other=0)
        c_e, c_o = _planes(ck)
        k_e = jnp.where(in_chunk[:, None], c_e, k_e)
        k_o = jnp.where(in_chunk[:, None], c_o, k_o)
    return k_e, k_o, valid


def _selected_keys(st: _Static, c, r, b, region, sel_ref, pt_ref, pages_ref):
    """Keys of selected chunk c (counted from the first selected chunk): bf16 planes and validity [64]."""
    d2, ns = st.d // 2, st.d // 16
    idx = sel_ref[r, pl.ds(c * CHUNK, CHUNK)]  # [64] i32
    valid = idx >= 0
    e = jnp.maximum(idx, 0)
    col = jnp.minimum(e >> st.n.bit_length() - 1, st.max_pages - 1)  # n is a power of two
    pg = plt.load(pt_ref.at[b, col])  # [64] i32
    base = pl.multiple_of(region + (e & (st.n - 1)) * st.eb, st.align)
    packed = plt.load(pages_ref.at[_bcast(pg, (CHUNK, d2)), _bcast(base, (CHUNK, d2)) + _iota(d2)[None, :]],
                      mask=_bcast(valid, (CHUNK, d2)), other=0)
    sb = plt.load(pages_ref.at[_bcast(pg, (CHUNK, ns)), _bcast(base + d2, (CHUNK, ns)) + _iota(ns)[None, :]],
                  mask=_bcast(valid, (CHUNK, ns)), other=0)
    scl = (_e4m3(sb, st.decode) * FP4_CVT_FACTOR[st.decode]).astype(BF16)  # [64, d/16]: element i: scale i // 8
    v_e, v_o = _fp4_planes(packed, st.decode, BF16)
    return _scaled(v_e, scl, 8), _scaled(v_o, scl, 8), valid


def _inverse_rope_planes(o_e, o_o, t, freqs):
    """dsv41_jax.rope.apply_rope(inverse=True) on bf16-rounded even / odd planes [.., d/2] (f32 in, f32 out) at
    position t; freqs [d/2] f32 is zero on the unrotated plane columns (cos 0 = 1, sin 0 = 0: exact identity)."""
    ang = t.astype(F32) * freqs
    cos, sin = jnp.cos(ang), -jnp.sin(ang)
    a = o_e.astype(BF16).astype(F32)
    b = o_o.astype(BF16).astype(F32)
    return a * cos - b * sin, a * sin + b * cos


def _plane_freqs(freqs, d: int):
    """[rope] RoPE frequencies -> [d/2] per plane column (zeros before the rotated tail)."""
    return jnp.pad(freqs.astype(F32), (d // 2 - freqs.shape[0], 0))


def _merge_splits(st: _Static, r, h, sink, acc_ref, m_ref, l_ref):
    """The last-arriving split of (row r, head block h) merges every split's (acc, m, l) partials: o [bh, d]
    f32 (the XLA `_merge`'s formula, splits added in order; loads bypass L1: other programs stored them)."""
    h0 = h * st.bh

    def ld(ref, sp, *tail):
        return common.load_uncached(ref.at[(r, sp, pl.ds(h0, st.bh)) + tail])

    mx = jax.lax.fori_loop(0, st.splits, lambda sp, a: jnp.maximum(a, ld(m_ref, sp)),
                           jnp.full((st.bh,), -jnp.inf, F32))

    def body(sp, c):
        num, den = c
        w = jnp.exp(ld(m_ref, sp) - mx)
        return num + ld(acc_ref, sp, pl.ds(0, st.d)) * w[:, None], den + ld(l_ref, sp) * w

    num, den = jax.lax.fori_loop(0, st.splits, body, (jnp.zeros((st.bh, st.d), F32), jnp.zeros((st.bh,), F32)))
    return num / (den + jnp.exp(sink - mx))[:, None]


def _kernel(pos0_ref, clip_ref, slot_ref, layer_ref, region_ref, q_ref, sink_ref, ckv_ref, ring_ref, *rest,
            st: _Static):
    if st.rope:
        freq_ref, *rest = rest
    if st.has_sel:
        sel_ref, pt_ref, pages_ref, *outs = rest
    else:
        sel_ref = pt_ref = pages_ref = None
        outs = rest
    r = pl.program_id(0)
    b = r // st.T
    pos0, clip = pos0_ref[b], clip_ref[b]
    t = pos0 + r % st.T
    rrow, region = layer_ref[0] * st.R + slot_ref[b], region_ref[0]
    q_e, q_o = _planes(q_ref[...])  # [bh, d/2] even / odd elements
    d2 = st.d // 2
    carry = (jnp.full((st.bh,), MAX_FLOOR, F32), jnp.zeros((st.bh,), F32),
             jnp.zeros((st.bh, d2), F32), jnp.zeros((st.bh, d2), F32))
    if st.splits == 1:
        lo, hi = 0, st.n_chunks
        clamp = lambda x: min(max(x, lo), hi)  # noqa: E731
    else:
        lo = pl.program_id(2) * st.per
        hi = jnp.minimum(lo + st.per, st.n_chunks)
        clamp = lambda x: jnp.minimum(jnp.maximum(x, lo), hi)  # noqa: E731

    def window_body(with_chunk):
        def body(c, cr):
            keys = _window_keys(st, c, b, t, pos0, clip, rrow, ckv_ref, ring_ref, with_chunk)
            return _step(st, cr, q_e, q_o, *keys)
        return body

    def sel_body(c, cr):
        return _step(st, cr, q_e, q_o, *_selected_keys(st, c - st.n_win, r, b, region, sel_ref, pt_ref, pages_ref))

    # window chunks [0, n_ring) cannot hold a position >= pos0 (row i's chunk positions are its last i + 1 slots)
    n_ring = max(0, min(st.n_win, (st.W - st.T) // CHUNK))
    if n_ring:
        carry = jax.lax.fori_loop(clamp(0), clamp(n_ring), window_body(False), carry)
    carry = jax.lax.fori_loop(clamp(n_ring), clamp(st.n_win), window_body(True), carry)
    if st.has_sel:
        carry = jax.lax.fori_loop(clamp(st.n_win), hi, sel_body, carry)
    m, l, acc_e, acc_o = carry

    def finish(o_e, o_o, store):
        if st.rope:
            o_e, o_o = _inverse_rope_planes(o_e, o_o, t, freq_ref[...][None, :])
        store(_interleave(o_e, o_o).astype(BF16 if st.out_bf16 else F32))

    if st.splits == 1:
        (o_ref,) = outs
        den = l + jnp.exp(sink_ref[...] - m)

        def store(v):
            o_ref[...] = v.astype(o_ref.dtype)

        finish(acc_e / den[:, None], acc_o / den[:, None], store)
    else:
        o_ref, acc_ref, m_ref, l_ref, cnt_ref = outs
        h, sp = pl.program_id(1), pl.program_id(2)
        h0 = h * st.bh
        plt.store(acc_ref.at[r, sp, pl.ds(h0, st.bh), pl.ds(0, st.d)], _interleave(acc_e, acc_o))
        plt.store(m_ref.at[r, sp, pl.ds(h0, st.bh)], m)
        plt.store(l_ref.at[r, sp, pl.ds(h0, st.bh)], l)

        @pl.when(common.last_arrival(cnt_ref, r * st.n_hb + h, st.splits, st.interpret))
        def _merge_here():
            o = _merge_splits(st, r, h, sink_ref[...], acc_ref, m_ref, l_ref)

            def store(v):
                plt.store(o_ref.at[r, pl.ds(h0, st.bh), pl.ds(0, st.d)], v.astype(o_ref.dtype))

            o_e, o_o = _planes(o)
            finish(o_e, o_o, store)


def _check(a: SparseAttentionOperands, kv: PagedAttentionKV):
    q, chunk_kv, ring, pages, page_table, sel = a.q, a.chunk_kv, kv.ring, kv.pages, kv.page_table, a.sel
    ratio = max(a.ratio, 1)
    B, T, H, d = q.shape
    L, R, W, e = ring.shape
    if d < 32 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 32")
    if e != d + d // 32 or ring.dtype != jnp.uint8:
        raise ValueError(f"ring entries must be uint8 of {d + d // 32} bytes, got {ring.dtype} {e}")
    if W % CHUNK:
        raise ValueError(f"window {W} must be a multiple of {CHUNK}")
    if chunk_kv.shape != (B, T, d):
        raise ValueError(f"chunk_kv {chunk_kv.shape} != {(B, T, d)}")
    if sel is not None:
        if kv.page_tokens % ratio or pages.dtype != jnp.uint8 or sel.shape[:2] != (B, T):
            raise ValueError("bad ratio / pages dtype / sel shape")
        if kv.entry_bytes != d // 2 + d // 16:
            raise ValueError(f"latent entries of {kv.entry_bytes} bytes: the kernel reads FP4 entries of "
                             f"{d // 2 + d // 16} (d/2 E2M1 + d/16 E4M3 scale bytes)")
        if page_table.shape[0] != B:
            raise ValueError("page_table rows != batch")


def paged_sparse_attention(a: SparseAttentionOperands, kv: PagedAttentionKV, *, scale: float, interpret=None,
                           block_sizes: BlockSizes | None = None, decode: str = "cvt", _poison_out: bool = False):
    """See the module docstring.

    block_sizes: launch configuration (heads per program, KV splits, warps); decode: "cvt" (E2M1 bits moved to
    E4M3, hardware conversion) or "int" (integer decoders of pallas_kernels.common); both are exact.
    _poison_out (tests): outputs start as NaN buffers aliased into the kernel, so unwritten blocks show."""
    if decode not in FP4_CVT_FACTOR:
        raise ValueError(f"unknown decode {decode!r}")
    _check(a, kv)
    interpret = common.interpret_default() if interpret is None else interpret
    q, sel = a.q, a.sel
    B, T, H, d = q.shape
    L, R, W, _ = kv.ring.shape
    n_win = W // CHUNK
    n_sel = 0 if sel is None else -(-sel.shape[-1] // CHUNK)
    bs = (block_sizes or BlockSizes()).resolve(B * T, H, n_win + n_sel)
    region = _scalar(0 if kv.region is None or sel is None else kv.region)
    try:
        concrete = int(region)
    except jax.errors.ConcretizationTypeError:
        concrete = 0
    if concrete % 16:
        raise ValueError(f"region {concrete} must be a multiple of 16")
    eb = kv.entry_bytes
    st = _Static(d=d, W=W, T=T, n_win=n_win, n_chunks=n_win + n_sel, per=bs.chunks_per_split,
                 splits=bs.num_splits, bh=bs.block_h, n=kv.page_tokens // max(a.ratio, 1), eb=eb,
                 max_pages=1 if sel is None else kv.page_table.shape[1], scale=float(scale), decode=decode,
                 align=math.gcd(eb, 16), has_sel=sel is not None, rope=0 if a.freqs is None else a.freqs.shape[0],
                 R=R, n_hb=bs.heads_padded // bs.block_h, interpret=interpret, out_bf16=q.dtype == jnp.bfloat16)
    return _call(st, bs, interpret, _poison_out, a, kv, region)


def _call(st: _Static, bs: ResolvedBlockSizes, interpret: bool, poison: bool, a: SparseAttentionOperands,
          kv: PagedAttentionKV, region):
    q, chunk_kv, ring, layer, ring_slot, pos0, clip = a.q, a.chunk_kv, kv.ring, _scalar(a.layer), kv.ring_slot, \
        a.pos0, a.clip
    pages, page_table, sel, sink = kv.pages, kv.page_table, a.sel, a.sink
    B, T, H, d = q.shape
    L, R, W, e = ring.shape
    BT, Hp, bh, S = B * T, bs.heads_padded, bs.block_h, bs.num_splits
    i32 = jnp.int32
    qr = q.reshape(BT, H, d)
    sk = sink.astype(F32)
    if Hp != H:
        qr = jnp.pad(qr, [(0, 0), (0, Hp - H), (0, 0)])
        sk = jnp.pad(sk, [(0, Hp - H)])
    # per-row metadata read in-kernel (row r: sequence r // T, position pos0 + r % T): no table built in XLA
    inputs = [pos0.astype(i32), clip.astype(i32), ring_slot.astype(i32), layer.reshape(1).astype(i32),
              _scalar(region).reshape(1), qr, sk, chunk_kv.astype(q.dtype), ring.reshape(L * R, W, e)]
    anyspec = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [anyspec] * 5 + [pl.BlockSpec((None, bh, d), lambda r, h, s: (r, h, 0)),
                                pl.BlockSpec((bh,), lambda r, h, s: (h,)), anyspec, anyspec]
    if st.rope:
        inputs.append(_plane_freqs(a.freqs, d))
        in_specs.append(pl.BlockSpec((d // 2,), lambda r, h, s: (0,)))
    if st.has_sel:
        sl = sel.reshape(BT, sel.shape[-1]).astype(i32)
        kp = (st.n_chunks - st.n_win) * CHUNK
        if kp != sl.shape[1]:
            sl = jnp.pad(sl, [(0, 0), (0, kp - sl.shape[1])], constant_values=-1)
        inputs += [sl, page_table.astype(i32), pages]
        in_specs += [anyspec] * 3
    o_shape = jax.ShapeDtypeStruct((BT, Hp, d), q.dtype)
    if S == 1:
        out_shape = [o_shape]
        out_specs = [pl.BlockSpec((None, bh, d), lambda r, h, s: (r, h, 0))]
    else:  # split partials, merged in-kernel by the last split of each (row, head block) to arrive
        out_shape = [o_shape, jax.ShapeDtypeStruct((BT, S, Hp, d), F32), jax.ShapeDtypeStruct((BT, S, Hp), F32),
                     jax.ShapeDtypeStruct((BT, S, Hp), F32), jax.ShapeDtypeStruct((BT * (Hp // bh),), i32)]
        out_specs = [anyspec] * 5
    kernel = functools.partial(_kernel, st=st)
    aliases = {}
    if poison:  # a NaN-filled output passed in and aliased: an unwritten block stays NaN
        inputs.append(jnp.full(o_shape.shape, jnp.nan, q.dtype))
        in_specs.append(anyspec)
        aliases[len(inputs) - 1] = 0
    if S > 1:
        inputs.append(jnp.zeros((BT * (Hp // bh),), i32))  # the arrival counters
        in_specs.append(anyspec)
        aliases[len(inputs) - 1] = 4
    if aliases:
        kernel = functools.partial(_drop_aliased, kernel, len(aliases), len(out_shape))
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(BT, Hp // bh, S), in_specs=in_specs, out_specs=out_specs,
        input_output_aliases=aliases, interpret=interpret, name="paged_sparse_attention",
        compiler_params=plt.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages))(*inputs)
    return outs[0][:, :H].reshape(B, T, H, d)


def _drop_aliased(kernel, n: int, n_out: int, *refs):
    """Kernel wrapper that ignores the n aliased inputs (the last inputs; the n_out outputs follow them)."""
    n_in = len(refs) - n_out
    return kernel(*refs[: n_in - n], *refs[n_in:])
