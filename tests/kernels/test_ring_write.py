"""The FP8 SWA ring-write kernel (pallas_kernels/ring_write, interpret mode, GPU-legal blocks) against its one jnp
reference, dsv41_jax.kv_cache.SwaPool.write (the ops seam's XLA branch): decode rows, a chunk with padding rows,
a chunk longer than the window (only its last W rows land); every byte of the pool compared, so a stray write
anywhere fails; the ops seam's Pallas branch; the GPU lowering at the full shape."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import ops, quant
from dsv41_jax.kv_cache import KVState, SwaPool
from pallas_kernels.common import lower_for_h200
from pallas_kernels.ring_write import ring_write

L, R, W, D = 3, 5, 64, 64
CFG = SimpleNamespace(qdq=True, head_dim=D, window_size=W, compute_dtype="bfloat16")


def _case(seed, B, T):
    rng = np.random.default_rng(seed)
    pool = jnp.asarray(rng.integers(0, 256, (L, R, W, D + D // 32)), jnp.uint8)  # random bytes everywhere
    scale = jnp.asarray(2.0 ** rng.integers(-12, 8, (B, T, 1)), jnp.float32)
    kv = quant.fp8_qdq((jnp.asarray(rng.normal(0, 1, (B, T, D))) * scale).astype(jnp.bfloat16), 32)
    slots = jnp.asarray(rng.permutation(R)[:B], jnp.int32)
    return pool, kv, slots


@pytest.mark.parametrize("B,T,pos0,n_valid", [
    (3, 1, [100, 7, 0], [1, 1, 0]),  # decode; the third row is padding (n_valid 0): nothing written
    (2, 5, [10, 62], [5, 3]),  # a chunk, wrapping the ring; sequence 1 has 2 padding rows
    (1, 100, [30], [90]),  # longer than the window: only the last W valid rows land
])
def test_kernel_matches_reference(B, T, pos0, n_valid):
    pool, kv, slots = _case(B * 100 + T, B, T)
    pos0, n_valid = jnp.asarray(pos0, jnp.int32), jnp.asarray(n_valid, jnp.int32)
    want = np.asarray(SwaPool(pool, slots).write(CFG, 1, kv, pos0, n_valid).pool)
    got = np.asarray(ring_write(pool, kv, slots, pos0, n_valid, jnp.int32(1)))
    np.testing.assert_array_equal(got, want)
    assert (want != np.asarray(pool)).any()  # something was written


def test_ops_pallas_branch_matches_xla():
    pool, kv, slots = _case(7, 2, 1)
    state = KVState(SwaPool(pool, slots), None, None)
    args = (CFG, state, jnp.int32(2), kv, jnp.asarray([5, 300], jnp.int32), jnp.ones((2,), jnp.int32))
    want = ops.ring_write(ops.ExecContext(), *args).swa.pool
    got = ops.ring_write(ops.ExecContext(kernels="pallas"), *args).swa.pool
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("B,T", [(1, 1), (32, 1), (2, 128)])
def test_lowers_for_the_h200_at_the_full_shape(B, T):
    sds = jax.ShapeDtypeStruct
    i32 = jnp.int32
    text = lower_for_h200(lambda p, kv, s, p0, nv, l: ring_write(p, kv, s, p0, nv, l, interpret=False),
                          sds((40, 33, 128, 528), jnp.uint8), sds((B, T, 512), jnp.bfloat16), sds((B,), i32),
                          sds((B,), i32), sds((B,), i32), sds((), i32))
    assert text.count("__gpu$xla.gpu.triton") == 1
