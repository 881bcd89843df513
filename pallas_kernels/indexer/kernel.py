"""Lightning-indexer scores over paged FP4 index keys, for a given list of 8-entry blocks (the model's side:
dsv41_jax.attention.index_scores; the page layout: dsv41_jax.kv_cache).

One op serves both uses of the indexer: the full scan of the candidate-source layer (every block of the
sequence's capacity) and the Reindex layers, which score only the entries of the 2048 candidate blocks, so
that their cost does not grow with the context.

  index_scores_paged(a: IndexerOperands, kv: PagedIndexKV)  (operands.py)
    a.q [B,T,Hi,di] bf16, a.w [B,T,Hi] bf16, a.blocks [B,T,nb] (or [B,1,nb], shared by every query row) int32
    ascending block ids, -1 = none, a.visible [B,T] int32; kv.pages [P, page_bytes] uint8, kv.page_table
    [B, max_pages] int32, kv.region int32 []  ->  scores [B,T,nb*block_size] f32

Column c*bs+u holds the score of entry blocks[c]*bs+u, -inf where the block is -1 or the entry >= visible.
Index-key entry layout (kv.page_tokens // ratio entries of kv.entry_bytes per page): di/2 packed E2M1 bytes
(low nibble = even element), then di/32 UE8M0 scale bytes; entry e sits at byte
page_table[b, e // n] * page_bytes + region + (e % n) * eb.

Rounding points (as dsv41_jax.attention.index_scores): s_h = bf16(q_h . k) with an f32 accumulation;
p_h = bf16(relu(s_h) * w_h) (product in f32, then rounded); score = bf16(sum_h p_h in f32), returned as f32.

Kernel (Pallas Triton): grid (B, T, columns / E); a program gathers its E entries' page ids from the page
table, loads the 64 packed bytes and the 4 scale bytes of each entry straight from the page pool (masked
loads: entries of -1 blocks or beyond `visible` read nothing and decode to 0), decodes the even/odd element
planes to bf16 in registers and scores them with two tensor-core dots, k_lo[E, di/2] @ q_even^T[di/2, Hi] +
k_hi @ q_odd^T -> [E, Hi] f32, then applies the rounding points above and reduces over heads.

Numerics contract (kernel vs `ref_index_scores_paged`):
- masking is exact: masked columns are exactly -inf, every other column is finite for finite inputs, and
  garbage (e.g. 0xFF-poisoned) bytes of masked entries, unused pages or other regions never reach an
  unmasked column (masked entries are not even read);
- values: the rounding points are the reference's; only f32 summation orders differ (the per-head dot as two
  half-dots of di/2 in tensor-core order, the 32-head sum as a tree), which can flip a bf16 rounding and
  move a score by a bf16 ulp. Stated bound (checked by the tests): |kernel - ref| <= 2^-6 * max(|ref|,
  row max |ref|) and at most 1% of the columns differ. Expected in practice: bit-exact. q and k are FP4 values
  times power-of-two scales, so every product has <= 4 significant bits and the 128-term dot is exact in f32
  in any order unless one vector's 32-element scales span ~2^16; the 32 p_h are bf16 (8 bits), so their f32
  sum is exact unless their magnitudes span ~2^16. A numpy simulation of other orders (sequential half-dots,
  sequential head sum) at full shape: 0 of 24K columns differ at realistic scales; with artificial scale
  spreads of 2^-30..2^1, 0.24% of the columns moved by one bf16 ulp and no top-512 selection changed.
  Interpret mode on CPU is bit-exact on the test inputs; bench.py measures the H200 (cols_diff, topk_eq).
The reference is bit-exact against the model's `index_scores` on the same keys (tested; the model compiled
without XLA:CPU's YNN fusions, which drop its bf16 rounding of relu(s) * w).
Preconditions: blocks lie inside the capacity (max_pages * 64 / ratio entries); page ids in the table are
< P (they are clamped, never trusted for the address).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common
from pallas_kernels.indexer.block_sizes import entries_per_program
from pallas_kernels.indexer.operands import IndexerOperands, PagedIndexKV

F32 = jnp.float32
BF16 = jnp.bfloat16
NEG_INF = float("-inf")
SCALE_BLOCK = 32  # the decoded format: a UE8M0 scale per 32 elements (16 packed bytes)


def decoded_entry_bytes(di: int) -> int:
    """Bytes of the one index-key entry format the decoders read (checked against the caller's layout)."""
    return di // 2 + di // SCALE_BLOCK


def _entries(blocks, block_size):
    """blocks [B,T,nb] -> entry ids [B,T,nb*bs] and the block-valid mask."""
    u = jnp.arange(block_size, dtype=jnp.int32)
    e = blocks[..., None] * block_size + u
    ok = jnp.broadcast_to(blocks[..., None] >= 0, e.shape)
    B, T, nb = blocks.shape
    return e.reshape(B, T, nb * block_size), ok.reshape(B, T, nb * block_size)


# ----------------------------------------------------------------------------- reference (pure jnp)
def gather_index_keys(pages, page_table, entries, valid, region, *, n, di, dtype=BF16):
    """Decode the index keys of `entries` [B, ...] (int32; rows where ~valid give 0) -> [B, ..., di]; n entries
    per page.

    The XLA gather-and-decode path: byte (page, offset) pairs per entry, then the E2M1 / UE8M0 decode of
    pallas_kernels.common (bit-exact with dsv41_jax.quant.fp4_unpack)."""
    half, eb = di // 2, decoded_entry_bytes(di)
    B = entries.shape[0]
    es = jnp.where(valid, entries, 0)
    slot = jnp.clip(es // n, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, slot.reshape(B, -1), axis=1).reshape(es.shape)
    page = jnp.clip(page, 0, pages.shape[0] - 1)
    off = jnp.reshape(region, ()).astype(jnp.int32) + (es % n) * eb
    byt = pages[page[..., None], off[..., None] + jnp.arange(eb, dtype=jnp.int32)]  # [..., eb] uint8
    packed, sbytes = byt[..., :half], byt[..., half:]
    vals = jnp.stack([common.e2m1_to_f32(common.low_nibble(packed)),
                      common.e2m1_to_f32(common.high_nibble(packed))], axis=-1)
    vals = vals.reshape(*es.shape, di // SCALE_BLOCK, SCALE_BLOCK)
    k = (vals * common.e8m0_to_f32(sbytes)[..., None]).reshape(*es.shape, di).astype(dtype)
    return jnp.where(valid[..., None], k, jnp.zeros((), dtype))


def round_bf16(x):
    """f32 -> f32 rounded to bf16 (nearest even). reduce_precision, unlike an astype(bf16).astype(f32) pair,
    is never removed by XLA's excess-precision rewrites, so the rounding points hold on every backend."""
    return jax.lax.reduce_precision(x.astype(F32), exponent_bits=8, mantissa_bits=7)


def score_keys(q, w, k, valid):
    """q [B,T,Hi,di], w [B,T,Hi], k [B,T,E,di] or [B,E,di] (shared by the T rows), valid [B,T,E] -> f32."""
    spec = "bthd,bted->bthe" if k.ndim == 4 else "bthd,bed->bthe"
    s = round_bf16(jnp.einsum(spec, q.astype(BF16), k.astype(BF16), preferred_element_type=F32))
    p = round_bf16(jnp.maximum(s, 0.0) * w.astype(F32)[..., None])
    return jnp.where(valid, round_bf16(jnp.sum(p, axis=2)), NEG_INF)


def ref_index_scores_paged(a: IndexerOperands, kv: PagedIndexKV):
    """Pure-jnp reference of `index_scores_paged` (same arguments and result)."""
    B, T = a.q.shape[:2]
    blocks = jnp.broadcast_to(a.blocks, (B, T, a.blocks.shape[-1])).astype(jnp.int32)
    e, ok = _entries(blocks, a.block_size)
    valid = ok & (e < a.visible[..., None])
    k = gather_index_keys(kv.pages, kv.page_table, e, valid, kv.region, n=kv.page_tokens // a.ratio,
                          di=a.q.shape[-1])
    return score_keys(a.q, a.w, k, valid)


# ----------------------------------------------------------------------------- kernel
def _cast_round_bf16(x):
    return x.astype(BF16).astype(F32)


def _kernel(qe_ref, qo_ref, w_ref, vis_ref, blk_ref, tab_ref, reg_ref, pages_ref, o_ref, *,
            E, bs, n, half, nsc, max_pages, n_pages, shared_blocks, interpret, round_total=True):
    # Triton lowers the cast pair to a real f32 -> bf16 -> f32 rounding; interpreted, the body is compiled by
    # XLA:CPU, whose fusions may drop such a pair, so there the rounding points use reduce_precision.
    rnd = round_bf16 if interpret else _cast_round_bf16
    b, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tb = 0 if shared_blocks else t
    col = j * E + jax.lax.broadcasted_iota(jnp.int32, (E,), 0)
    blk = blk_ref[b, tb, col // bs]  # [E] gather: the block of each column
    ent = blk * bs + col % bs
    valid = (blk >= 0) & (ent < vis_ref[b, t])
    es = jnp.where(valid, ent, 0)
    page = tab_ref[b, jnp.minimum(es // n, max_pages - 1)]  # [E] gather from the page table
    page = jnp.minimum(jnp.maximum(page, 0), n_pages - 1)
    off = reg_ref[0] + (es % n) * (half + nsc)  # byte offset of each entry inside its page
    # packed E2M1 bytes [E, half]: masked rows read nothing and decode to +0
    pidx = jnp.broadcast_to(page[:, None], (E, half))
    bidx = off[:, None] + jax.lax.broadcasted_iota(jnp.int32, (E, half), 1)
    vmask = jnp.broadcast_to(valid[:, None], (E, half))
    packed = plt.load(pages_ref.at[pidx, bidx], mask=vmask, other=0)
    # UE8M0 scale bytes [E, nsc], broadcast to the [E, half] packed columns (16 bytes = 32 elements each)
    sp = jnp.broadcast_to(page[:, None], (E, nsc))
    sidx = off[:, None] + half + jax.lax.broadcasted_iota(jnp.int32, (E, nsc), 1)
    sb = plt.load(pages_ref.at[sp, sidx], mask=jnp.broadcast_to(valid[:, None], (E, nsc)), other=0)
    scale = jnp.broadcast_to(common.e8m0_to_f32(sb)[:, :, None], (E, nsc, SCALE_BLOCK // 2)).reshape(E, half)
    k_lo = (common.e2m1_to_f32(common.low_nibble(packed)) * scale).astype(BF16)  # even elements
    k_hi = (common.e2m1_to_f32(common.high_nibble(packed)) * scale).astype(BF16)  # odd elements
    s = plt.dot(k_lo, qe_ref[...]) + plt.dot(k_hi, qo_ref[...])  # [E, Hi] f32
    s = rnd(s)
    p = rnd(jnp.maximum(s, 0.0) * w_ref[...].astype(F32)[None, :])
    tot = jnp.sum(p, axis=1)
    o_ref[...] = jnp.where(valid, rnd(tot) if round_total else tot, NEG_INF)


def _pallas_scores(a: IndexerOperands, kv: PagedIndexKV, *, interpret, entries, round_total=True):
    q, w, blocks, visible, block_size = a.q, a.w, a.blocks, a.visible, a.block_size
    pages, page_table, region = kv.pages, kv.page_table, kv.region
    B, T, Hi, di = q.shape
    if Hi < 16:  # the dot needs 16 columns: heads of weight 0 add exactly +0 to every head sum
        q = jnp.pad(q, [(0, 0), (0, 0), (0, 16 - Hi), (0, 0)])
        w = jnp.pad(w, [(0, 0), (0, 0), (0, 16 - Hi)])
        Hi = 16
    nb = blocks.shape[-1]
    shared = blocks.shape[1] == 1 and T > 1
    cols = nb * block_size
    E = entries or entries_per_program(B * T, cols, block_size)
    if E % block_size:
        raise ValueError(f"entries per program {E} must be a multiple of block_size {block_size}")
    if not interpret and any(x & (x - 1) or x < 16 for x in (Hi, di // 2, E)):
        raise ValueError(f"Triton needs powers of two >= 16 for Hi={Hi}, di/2={di // 2} and entries={E}")
    pad = -cols % E
    if pad:  # whole -1 blocks: scored as masked, sliced off below
        blocks = jnp.pad(blocks, [(0, 0), (0, 0), (0, pad // block_size)], constant_values=-1)
    # even / odd element planes, transposed to [di/2, Hi] so the dot is k[E, di/2] @ q^T
    qe = jnp.swapaxes(q[..., 0::2], -1, -2).astype(BF16)
    qo = jnp.swapaxes(q[..., 1::2], -1, -2).astype(BF16)
    half = di // 2
    kern = functools.partial(_kernel, E=E, bs=block_size, n=kv.page_tokens // a.ratio, half=half,
                             nsc=di // SCALE_BLOCK, max_pages=page_table.shape[1], n_pages=pages.shape[0],
                             shared_blocks=shared, interpret=bool(interpret), round_total=round_total)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid = (B, T, (cols + pad) // E)
    out = pl.pallas_call(
        kern,
        out_shape=jax.ShapeDtypeStruct((B, T, cols + pad), F32),
        grid=grid,
        in_specs=[pl.BlockSpec((None, None, half, Hi), lambda b, t, j: (b, t, 0, 0)),
                  pl.BlockSpec((None, None, half, Hi), lambda b, t, j: (b, t, 0, 0)),
                  pl.BlockSpec((None, None, Hi), lambda b, t, j: (b, t, 0)),
                  any_spec, any_spec, any_spec, any_spec, any_spec],
        out_specs=pl.BlockSpec((None, None, E), lambda b, t, j: (b, t, j)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="index_scores_paged",
    )(qe, qo, w.astype(BF16), visible.astype(jnp.int32), blocks.astype(jnp.int32),
      page_table.astype(jnp.int32), jnp.reshape(region, (1,)).astype(jnp.int32), pages)
    return out[..., :cols] if pad else out


@functools.partial(jax.jit, static_argnames=("interpret", "implementation", "entries", "head_partial"))
def index_scores_paged(a: IndexerOperands, kv: PagedIndexKV, *, interpret: bool | None = None,
                       implementation: str = "pallas", entries: int | None = None, head_partial: bool = False):
    """Indexer scores [B,T,nb*block_size] f32 of the entries of `a.blocks` (see the module docstring).

    implementation: "pallas" (the kernel; interpret=None means interpret mode on CPU) or "xla" (the
    reference). entries: columns per program (None: block_sizes.entries_per_program). head_partial (Pallas):
    the f32 sum of a's heads' rounded terms without the final bf16 rounding, for a tensor-parallel rank
    holding some of the heads (the ranks' partials are summed, then rounded once: dsv41_jax.parallel)."""
    B, T, Hi, di = a.q.shape
    blocks, ratio = a.blocks, a.ratio
    if kv.page_tokens % ratio or di % SCALE_BLOCK:
        raise ValueError(f"bad ratio {ratio} or index head dim {di}")
    if kv.entry_bytes != decoded_entry_bytes(di):
        raise ValueError(f"index-key entries of {kv.entry_bytes} bytes: the kernel reads FP4 entries of "
                         f"{decoded_entry_bytes(di)} (di/2 E2M1 + di/32 UE8M0 scale bytes)")
    if blocks.ndim != 3 or blocks.shape[0] != B or blocks.shape[1] not in (1, T):
        raise ValueError(f"blocks {blocks.shape} must be [B, T or 1, nb] for q {a.q.shape}")
    if implementation == "xla":
        return ref_index_scores_paged(a, kv)
    if implementation != "pallas":
        raise ValueError(f"unknown implementation {implementation!r}")
    if interpret is None:
        interpret = common.interpret_default()
    return _pallas_scores(a, kv, interpret=interpret, entries=entries, round_total=not head_partial)
