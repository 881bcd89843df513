"""The FP8 SWA ring write in one Pallas kernel: a chunk's entries quantised, packed and stored in place into the
engine's ring pool (its jnp reference: dsv41_jax.kv_cache.SwaPool.write, i.e. kv_format.swa_pack + a scatter).

    ring_write(pool [L, R, W, e] uint8, kv [B, T, d], slots [B], pos0 [B], n_valid [B], layer []) -> pool

Row i of sequence b (position pos0[b] + i) is written iff it is one of the chunk's last min(W, n_valid[b]) valid
rows, at pool[layer, slots[b], (pos0[b] + i) % W]: d E4M3 bytes of kv / scale, then d/32 UE8M0 scale codes
(dsv41_jax.quant.fp8_encode's rule, with pallas_kernels.common.fp8_encode_block: bit-exact). Nothing else of
the pool is touched (the pool is aliased in and out: XLA updates it in place when the caller donates or carries
it). Grid (B, row tiles of bt rows); the E4M3 values leave as bytes through an 8-bit bitcast.

Requirements: d a multiple of 32, e = d + d/32, rows in a tile write distinct slots (the kept rows are at most W
consecutive positions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import fp8_encode_block, interpret_default

BLOCK = 32


def _kernel(meta_ref, kv_ref, pool_in, pool_ref, *, T: int, W: int, R: int, d: int, bt: int):
    del pool_in  # aliased to pool_ref
    b, tile = pl.program_id(0), pl.program_id(1)
    pos0, n_valid, slot_row = meta_ref[b, 0], meta_ref[b, 1], meta_ref[b, 2]
    i = tile * bt + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
    keep = (i < T) & (i < n_valid) & (i >= n_valid - W)
    slot = jax.lax.rem(pos0 + i, W)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, d), 1)
    rows = jnp.broadcast_to(jnp.minimum(i, T - 1)[:, None], (bt, d))
    x = plt.load(kv_ref.at[jnp.broadcast_to(b, (bt, d)), rows, cols], mask=keep[:, None], other=0.0)
    q, code, _ = fp8_encode_block(x.astype(jnp.float32), BLOCK)
    qb = jax.lax.bitcast_convert_type(q, jnp.uint8)
    prow = jnp.broadcast_to(slot_row, (bt, d))
    pslot = jnp.broadcast_to(slot[:, None], (bt, d))
    plt.store(pool_ref.at[prow, pslot, cols], qb, mask=jnp.broadcast_to(keep[:, None], (bt, d)))
    ns = d // BLOCK
    scols = d + jax.lax.broadcasted_iota(jnp.int32, (bt, ns), 1)
    plt.store(pool_ref.at[jnp.broadcast_to(slot_row, (bt, ns)), jnp.broadcast_to(slot[:, None], (bt, ns)), scols],
              code.astype(jnp.uint8), mask=jnp.broadcast_to(keep[:, None], (bt, ns)))


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=())
def _call(pool, kv, slots, pos0, n_valid, layer, *, interpret: bool):
    L, R, W, e = pool.shape
    B, T, d = kv.shape
    bt = min(16, 1 << max(T - 1, 0).bit_length())
    meta = jnp.stack([pos0, n_valid, layer * R + slots], axis=1).astype(jnp.int32)
    any_ = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, T=T, W=W, R=R, d=d, bt=bt), grid=(B, pl.cdiv(T, bt)), in_specs=[any_] * 3,
        out_shape=jax.ShapeDtypeStruct((L * R, W, e), jnp.uint8), out_specs=any_, input_output_aliases={2: 0},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1), interpret=interpret, name="swa_ring_write")(
        meta, kv, pool.reshape(L * R, W, e))
    return out.reshape(L, R, W, e)


def ring_write(pool, kv, slots, pos0, n_valid, layer, *, interpret: bool | None = None):
    """See the module docstring. kv [B, T, d] (FP8-representable values in any float dtype)."""
    L, R, W, e = pool.shape
    d = kv.shape[-1]
    if d % BLOCK or e != d + d // BLOCK or pool.dtype != jnp.uint8:
        raise ValueError(f"ring_write: pool {pool.shape} {pool.dtype} for entries of d={d} (needs d + d/32 bytes)")
    interpret = interpret_default() if interpret is None else interpret
    i32 = jnp.int32
    return _call(pool, kv, jnp.asarray(slots, i32), jnp.asarray(pos0, i32), jnp.asarray(n_valid, i32),
                 jnp.asarray(layer, i32), interpret=interpret)
