"""Microbenchmark cases of the FP8 SWA ring-write kernel (quantise, pack, store in place). The XLA side is the
model's path, dsv41_jax.kv_cache.SwaPool.write (kv_format.swa_pack + a scatter into the pool).

`cases(smoke=False)` -> list of dicts: name, fn_pallas, fn_xla, make_args, bytes (decode rows B = 1, 8, 32, 256 of
the full model's d = 512, window 128, into a 40-layer pool of max(B, 32) + 1 rows; smoke: d = 64, W = 64, B = 3).
`variants()` the same for bench/fused_kernels.py, with the pool as the loop carry (updated in place there).
Both sides return the whole pool; XLA updates it in place only when the caller donates it or carries it, so a
single timed call (wall / device time) may include a pool copy on both sides.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp

from dsv41_jax import quant
from dsv41_jax.kv_cache import SwaPool
from pallas_kernels.ring_write import ring_write

NS = (1, 8, 32, 256)


def _shape(smoke, n=1):
    return (3, 5, 64, 64) if smoke else (40, max(n, 32) + 1, 128, 512)  # L, R, W, d


def make_args(n, smoke, seed=0):
    L, R, W, d = _shape(smoke, n)
    k = jax.random.split(jax.random.key(seed), 3)
    pool = jax.random.randint(k[0], (L, R, W, d + d // 32), 0, 256, jnp.int32).astype(jnp.uint8)
    kv = quant.fp8_qdq(jax.random.normal(k[1], (n, 1, d), jnp.bfloat16), 32)
    slots = jax.random.permutation(k[2], R)[:n].astype(jnp.int32)
    pos0 = jnp.arange(n, dtype=jnp.int32) * 37 + 1000
    return pool, kv, slots, pos0, jnp.ones((n,), jnp.int32), jnp.int32(L // 2)


@jax.jit
def fused(pool, kv, slots, pos0, n_valid, layer):
    return ring_write(pool, kv, slots, pos0, n_valid, layer)


@functools.partial(jax.jit, static_argnames=("smoke",))
def _reference(pool, kv, slots, pos0, n_valid, layer, smoke=False):
    L, R, W, d = _shape(smoke)
    cfg = SimpleNamespace(qdq=True, head_dim=d, window_size=W, compute_dtype="bfloat16")
    return SwaPool(pool, slots).write(cfg, layer, kv, pos0, n_valid).pool


def reference(smoke):
    return functools.partial(_reference, smoke=smoke)


def nbytes(n, smoke):
    d = _shape(smoke)[3]
    return n * (d * 2 + d + d // 32)


def cases(smoke: bool = False) -> list[dict]:
    return [{"name": f"ring_write_B{n}", "fn_pallas": fused, "fn_xla": reference(smoke),
             "make_args": functools.partial(make_args, n, smoke), "bytes": nbytes(n, smoke)}
            for n in ((3,) if smoke else NS)]


def variants(smoke: bool = False) -> list[dict]:
    return [{"op": "ring_write", "n": n, "make_args": functools.partial(make_args, n, smoke),
             "bytes": nbytes(n, smoke), "reference": reference(smoke), "fused": {"fused": fused},
             "unfused": {"xla": reference(smoke)}, "n_layers": _shape(smoke)[0], "carry": 0}
            for n in ((3,) if smoke else NS)]
