"""The LM head on the checkpoint's bf16 weight: gemm.split_bf16x3 is exact, gemm.matmul_f32x (interpret mode)
matches the f32 reference x @ f32(w)^T within the summation-order bound on random inputs, where x rounded to one
bf16 term does not; ops.lm_head picks it only for a bf16 head; checkpoints.kernel_layout.head_as_stored converts
only an exactly-bf16 head, without touching its input; the full head lowers for the H200."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.kernel_layout import head_as_stored
from dsv41_jax import ops
from pallas_kernels import common
from pallas_kernels.gemm import matmul, matmul_f32x, split_bf16x3

INTERPRET = jax.default_backend() == "cpu"
N, K = 96, 256


def _x(M, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (M, K), jnp.float32)
    return x * jnp.exp2(jax.random.randint(k2, (M, K), -12, 12).astype(jnp.float32))  # many binades


def _w(seed=1):
    return jax.random.normal(jax.random.key(seed), (N, K), jnp.float32).astype(jnp.bfloat16)


def _err_and_bound(y, x, w):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    ref = x64 @ w64.T
    return np.abs(np.asarray(y, np.float64) - ref), np.abs(x64) @ np.abs(w64).T


def test_split_bf16x3_is_exact():
    x = _x(64)
    parts = split_bf16x3(x)
    assert all(p.dtype == jnp.bfloat16 for p in parts)
    total = sum(np.asarray(p, np.float64) for p in parts)
    np.testing.assert_array_equal(total, np.asarray(x, np.float64))
    assert np.any(np.asarray(parts[2]) != 0)  # the third term is needed


@pytest.mark.parametrize("M", [1, 3, 8])
def test_matmul_f32x_matches_f32_reference(M):
    x, w = _x(M, seed=M), _w()
    y = matmul_f32x(x, w, interpret=INTERPRET)
    assert y.shape == (M, N) and y.dtype == jnp.float32
    err, bound = _err_and_bound(y, x, w)
    assert np.all(err <= 1e-5 * bound + 1e-30), float((err / bound).max())
    # x rounded to bf16 alone (what a plain bf16 GEMM would read) is far outside the bound
    e1, _ = _err_and_bound(matmul(x.astype(jnp.bfloat16), w, interpret=INTERPRET), x, w)
    assert np.any(e1 > 1e-4 * bound)  # 10x the bound


def test_matmul_f32x_rejects_bad_operands():
    with pytest.raises(ValueError, match="bf16"):
        matmul_f32x(_x(1), _w().astype(jnp.float32))
    with pytest.raises(ValueError):
        matmul_f32x(_x(1)[:, :128], _w())


def test_ops_lm_head_picks_the_kernel_only_for_a_bf16_head():
    x = _x(3).reshape(1, 3, K)
    wb = _w()
    wf = wb.astype(jnp.float32)
    xla = ops.lm_head(ops.DEFAULT, x, wf)
    np.testing.assert_array_equal(np.asarray(ops.lm_head(ops.DEFAULT, x, wb)), np.asarray(xla))  # XLA: f32(w)
    pallas = ops.ExecContext(kernels="pallas")
    np.testing.assert_array_equal(np.asarray(ops.lm_head(pallas, x, wf)), np.asarray(xla))  # f32 head: XLA's GEMM
    y = ops.lm_head(pallas, x, wb)
    assert y.shape == (1, 3, N)
    err, bound = _err_and_bound(y.reshape(3, N), x.reshape(3, K), wb)
    assert np.all(err <= 1e-5 * bound + 1e-30)
    kept = ops.ExecContext(kernels="pallas", xla_ops=("lm_head",))
    np.testing.assert_array_equal(np.asarray(ops.lm_head(kept, x, wb)), np.asarray(xla))


def test_head_as_stored_converts_only_exact_bf16_heads():
    wf = _w().astype(jnp.float32)
    tree = {"head": {"weight": wf}, "norm": {"weight": jnp.ones((K,), jnp.float32)}}
    out, converted = head_as_stored(tree)
    assert converted and out["head"]["weight"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["head"]["weight"], np.float32), np.asarray(wf))
    assert tree["head"]["weight"] is wf and out["norm"] is tree["norm"]  # the input tree is untouched
    off = {"head": {"weight": wf + 1e-3}}  # not bf16 values: kept f32
    same, converted = head_as_stored(off)
    assert not converted and same is off
    abstract, converted = head_as_stored({"head": {"weight": jax.ShapeDtypeStruct((N, K), jnp.float32)}})
    assert converted and abstract["head"]["weight"].dtype == jnp.bfloat16


def test_full_head_lowers_for_h200():
    """medium / the full model's head: 129,280 x 5,120 bf16, batch 1 and 8 (3 and 24 GEMM rows)."""
    for M in (1, 8):
        text = common.lower_for_h200(lambda x, w: matmul_f32x(x, w, interpret=False),
                                     jax.ShapeDtypeStruct((M, 5120), jnp.float32),
                                     jax.ShapeDtypeStruct((129280, 5120), jnp.bfloat16))
        assert "__gpu$xla.gpu.triton" in text
