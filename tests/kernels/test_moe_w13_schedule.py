"""The fused w1 / w3 FP8-dot MoE kernel's weight schedules (MoeBlock.w13: "joint", "serial", "grid";
pallas_kernels/moe/fp8_kernel.py) in interpret mode against the model's sequence of ops on random MXFP4 experts and
FP8 activations: uneven groups with padding rows, swapped and plain dots, K splits, prefetch. The output buffer is
poisoned (NaN) before the call, so every row a work item owns must be written by the kernel (and the padding rows,
which no item owns, stay poisoned); with the default zero buffer the padding rows come back 0 and the schedules
agree with the joint kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels.moe import MoeBlock, fp8_kernel, grouped_swiglu, ref_grouped_swiglu
from tests.kernels.test_fp8_dot import fp8_rows

INTERPRET = jax.default_backend() == "cpu"
E, N, K = 8, 64, 256
GROUPS = (3, 0, 21, 1, 0, 9, 0, 2)  # 36 rows, 4 padding rows; empty experts 1, 4, 6
M = 40


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.key(31), 4)
    w = jax.random.normal(k[1], (2, E, N, K // 32, 32))
    w = (w * jnp.exp2(jax.random.randint(k[2], (2, E, N, K // 32, 1), -5, 3))).reshape(2, E, N, K)
    p, s = quant.quantize_weight_fp4(w)
    rw = jax.random.uniform(k[3], (M,), jnp.float32, 0.05, 1.0)
    return p, s, rw, fp8_rows(k[0], M, K)


def _run(data, blk):
    p, s, rw, (xb, xq, xc) = data
    gs = jnp.asarray(GROUPS, jnp.int32)
    h = grouped_swiglu(xq, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.5, x_scale=xc, block=blk,
                       interpret=INTERPRET)
    assert h.dtype == jnp.bfloat16 and h.shape == (M, N)
    return np.asarray(h, np.float64)


def _ref(data):
    p, s, rw, (xb, _, _) = data
    gs = jnp.asarray(GROUPS, jnp.int32)
    return np.asarray(ref_grouped_swiglu(xb, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.5), np.float64)


def _close(h, ref):
    """Within one bf16 rounding of the reference (the GEMMs' summation order may flip a rounding of g or u)."""
    n = sum(GROUPS)
    assert np.all(np.isfinite(h[:n]))
    np.testing.assert_allclose(h[:n], ref[:n], rtol=2 ** -7, atol=1e-6 * np.abs(ref).max())
    assert np.mean(h[:n] == ref[:n]) > 0.95 and np.abs(ref[:n]).max() > 0.1


BLOCKS = [MoeBlock(2, 32, 256, decode="fp8", nb=8, swap=True, fast_accum=True, w13="grid"),
          MoeBlock(4, 64, 128, splits=2, decode="fp8", nb=4, w13="grid"),
          MoeBlock(8, 32, 128, decode="fp8", nb=2, swap=True, prefetch=True, w13="grid"),
          MoeBlock(2, 32, 256, decode="fp8", nb=8, swap=True, w13="serial"),
          MoeBlock(8, 32, 64, splits=2, decode="fp8", nb=2, prefetch=True, w13="serial")]


@pytest.mark.parametrize("blk", BLOCKS)
def test_w13_schedules_poisoned_output(data, blk, monkeypatch):
    """Every owned output element is written: the buffer the kernel stores into starts as NaN."""
    monkeypatch.setattr(fp8_kernel, "_out_init", lambda shape, dtype: jnp.full(shape, jnp.nan, dtype))
    fp8_kernel.swiglu_fp8.clear_cache()
    try:
        h = _run(data, blk)
    finally:
        fp8_kernel.swiglu_fp8.clear_cache()
    n = sum(GROUPS)
    _close(h, _ref(data))
    assert np.all(np.isnan(h[n:]))  # padding rows: no work item owns them, nothing writes them


@pytest.mark.parametrize("blk", BLOCKS[:2] + BLOCKS[3:4])
def test_w13_schedules_match_joint(data, blk):
    """With the zero buffer: padding rows 0, and the schedule gives the joint kernel's result (the same sums per
    weight; the grid's SwiGLU runs in the wrapper instead of the kernel's epilogue)."""
    from dataclasses import replace

    h = _run(data, blk)
    joint = _run(data, replace(blk, w13="joint"))
    n = sum(GROUPS)
    np.testing.assert_array_equal(h[n:], 0.0)
    _close(h, _ref(data))
    np.testing.assert_allclose(h[:n], joint[:n], rtol=2 ** -7, atol=1e-6 * np.abs(joint).max())
    assert np.mean(h[:n] == joint[:n]) > 0.98


def test_w13_block_checks(data):
    p, s, rw, (xb, xq, xc) = data
    gs = jnp.asarray(GROUPS, jnp.int32)
    for blk, fp8x in ((MoeBlock(16, 32, 128, w13="grid"), False),
                      (MoeBlock(2, 32, 256, decode="fp8", nb=8, w13="rows"), True)):
        with pytest.raises(ValueError, match="w13"):
            grouped_swiglu(xq if fp8x else xb, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1],
                           x_scale=xc if fp8x else None, block=blk, interpret=INTERPRET)
