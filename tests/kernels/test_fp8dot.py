"""pallas_kernels/fp8dot.py, the pieces both FP8 x FP8 kernels build their dot from, against plain numpy on
random inputs: a block-diagonal activation tile times the weight tile, scaled per (row, block) x (column, block)
and folded over the blocks, equals the dot product of the dequantized operands (both orientations)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8dot

E4M3 = jnp.float8_e4m3fn


def test_pow2_and_expand_rows():
    codes = np.array([[127, 128], [120, 134]], np.uint8)
    np.testing.assert_array_equal(np.asarray(fp8dot.pow2(jnp.asarray(codes))), 2.0 ** (codes.astype(np.float64) - 127))
    np.testing.assert_array_equal(np.asarray(fp8dot.pow2(jnp.asarray(codes), 3)), 2.0 ** (codes - 124.0))
    s = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(np.asarray(fp8dot.expand_rows(jnp.asarray(s), 4)), np.repeat(s, 4, axis=0))


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("nb", [1, 4])
def test_block_diagonal_dot_equals_the_dequantized_product(swap, nb):
    rng = np.random.default_rng(nb + 10 * swap)
    R, cpb, bn = 4, 32, 16
    C = nb * cpb
    x = jnp.asarray(rng.normal(0, 2, (R, C)), jnp.float32).astype(E4M3)
    w = jnp.asarray(rng.normal(0, 2, (bn, C)), jnp.float32).astype(E4M3)
    cx = rng.integers(118, 136, (R, nb)).astype(np.int32)
    cw = rng.integers(118, 136, (bn, nb)).astype(np.int32)
    sx, sw = fp8dot.pow2(jnp.asarray(cx)), fp8dot.pow2(jnp.asarray(cw))
    a = fp8dot.block_diag(jnp.asarray(x).view(jnp.uint8), nb, cpb)
    assert a.shape == (R * nb, C) and a.dtype == E4M3
    af, wf = np.asarray(a.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
    p = wf @ af.T if swap else af @ wf.T
    y = np.asarray(fp8dot.fold(jnp.asarray(p) * fp8dot.scale_grid(sx, sw, swap), R, nb, swap))
    xd = np.asarray(x.astype(jnp.float32)) * np.repeat(np.asarray(sx), cpb, axis=1)
    wd = wf * np.repeat(np.asarray(sw), cpb, axis=1)
    want = wd @ xd.T if swap else xd @ wd.T
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
