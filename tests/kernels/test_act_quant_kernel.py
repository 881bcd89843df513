"""The one-launch FP8 quantiser (pallas_kernels/act_quant_kernel.py) against its references: its E4M3 codes and f32
block multipliers equal dsv41_jax.quant.fp8_encode's (and `quantize_ref`'s) bit for bit on random rows spread over
binades (zero blocks and saturating values included, several tiles per row and column); it lowers for the H200 with
nothing left for XLA; and the dense and MoE kernels fed its multipliers as `x_scale` equal the same kernels fed
fp8_encode's E8M0 codes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels import act_quant_kernel, common
from pallas_kernels.gemm import GemmBlock, matmul
from pallas_kernels.moe import grouped_matmul
from tests.kernels import test_fp8_dot
from tests.kernels.test_act_quant import MOE_BLOCKS, raw_rows
from tests.kernels.test_fp8_dot import GROUPS, INTERPRET, K, M

dense = test_fp8_dot.dense  # its FP8 block-32 weights fixture
experts = test_fp8_dot.experts  # its MXFP4 experts fixture

@pytest.mark.parametrize("m,k", [(1, 5120), (6, 2304), (8, 1280), (3, 96), (48, 512), (24, 8192)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_act_quant_kernel_equals_fp8_encode(m, k, dtype):
    """pallas_kernels/act_quant_kernel.py: the codes and multipliers of a whole array in one kernel equal
    quant.fp8_encode's codes and decoded scales bit for bit (zero blocks, saturating values, several tiles)."""
    x = raw_rows(jax.random.key(m * k), m, k, dtype)
    codes, mult = act_quant_kernel.quantize(x, interpret=INTERPRET)
    q, c = quant.fp8_encode(x, 32)
    assert codes.dtype == jnp.uint8 and mult.dtype == jnp.float32 and mult.shape == (m, k // 32)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)))
    np.testing.assert_array_equal(np.asarray(mult), np.asarray(quant.e8m0_code_to_f32(c)))
    r_codes, r_mult = act_quant_kernel.quantize_ref(x)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(r_codes))
    np.testing.assert_array_equal(np.asarray(mult), np.asarray(r_mult))


def test_act_quant_kernel_tiles_and_bad_shapes():
    assert act_quant_kernel.tiles(1, 5120) == (1, 1024)
    assert act_quant_kernel.tiles(6, 2304) == (2, 256)
    assert act_quant_kernel.tiles(48, 512) == (16, 512)
    for m, k in ((1, 5120), (6, 2304), (7, 96), (256, 8192)):
        bm, bk = act_quant_kernel.tiles(m, k)
        assert m % bm == 0 and k % bk == 0 and bk % 32 == 0 and bm * bk <= act_quant_kernel.MAX_TILE
    with pytest.raises(ValueError, match="K % 32"):
        act_quant_kernel.quantize(jnp.ones((2, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        act_quant_kernel.quantize(jnp.ones((2, 3, 64), jnp.bfloat16))


def test_act_quant_kernel_lowers_for_h200():
    for m, k in ((1, 5120), (6, 2304), (192, 2304)):
        text = common.lower_for_h200(lambda x: act_quant_kernel.quantize(x, interpret=False),
                                     jax.ShapeDtypeStruct((m, k), jnp.bfloat16))
        assert text.count("__gpu$xla.gpu.triton") == 1
        outside = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" not in line]
        assert not any("reduce" in line for line in outside)  # nothing left for XLA to compute


@pytest.mark.parametrize("blk", [GemmBlock(2, 64, 256, decode="fp8", nb=8, swap=True), GemmBlock(16, 32, 64, 2)])
def test_dense_takes_f32_multipliers(dense, blk):
    """gemm.matmul with x as the kernel's (uint8 codes, f32 multipliers) equals it with (E4M3, E8M0 codes)."""
    q, s = dense
    x = raw_rows(jax.random.key(3), 5, K)
    e4, e8 = quant.fp8_encode(x, 32)
    codes, mult = act_quant_kernel.quantize(x, interpret=INTERPRET)
    for impl in ("pallas", "xla"):
        kw = dict(scale=s, layer=1, implementation=impl, interpret=INTERPRET) | ({"block": blk} if impl == "pallas"
                                                                                   else {})
        np.testing.assert_array_equal(np.asarray(matmul(codes, q, x_scale=mult, **kw)),
                                      np.asarray(matmul(e4, q, x_scale=e8, **kw)))


@pytest.mark.parametrize("blk", [MOE_BLOCKS[0], MOE_BLOCKS[2]])
def test_grouped_takes_f32_multipliers(experts, blk):
    p, s, _ = experts
    gs = jnp.asarray(GROUPS, jnp.int32)
    x = raw_rows(jax.random.key(4), M, K)
    e4, e8 = quant.fp8_encode(x, 32)
    codes, mult = act_quant_kernel.quantize(x, interpret=INTERPRET)
    kw = dict(scale=s, layer=0, block=blk, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(grouped_matmul(codes, p, gs, x_scale=mult, **kw)),
                                  np.asarray(grouped_matmul(e4, p, gs, x_scale=e8, **kw)))
