"""In-kernel byte decoders are bit-exact against ml_dtypes / dsv41_jax.quant for every code, and a trivial
Pallas kernel using them lowers for the H200 from this CPU."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from dsv41_jax import quant
from pallas_kernels import common


def test_e4m3_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(common.e4m3_to_f32(jnp.asarray(b)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])
    assert np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def test_e8m0_all_bytes():
    b = np.arange(255, dtype=np.uint8)
    want = np.asarray(quant.e8m0_code_to_f32(jnp.asarray(b)))
    np.testing.assert_array_equal(np.asarray(common.e8m0_to_f32(jnp.asarray(b))), want)


def test_e2m1_all_bytes_and_nibbles():
    b = np.arange(256, dtype=np.uint8)
    lo = np.asarray(common.e2m1_to_f32(common.low_nibble(jnp.asarray(b))))
    hi = np.asarray(common.e2m1_to_f32(common.high_nibble(jnp.asarray(b))))
    want = quant.FP4_VALUES[np.stack([b & 15, b >> 4], -1).astype(np.int32)]
    np.testing.assert_array_equal(np.stack([lo, hi], -1), want)
    assert np.array_equal(np.signbit(np.stack([lo, hi], -1)), np.signbit(want))


def _decode_kernel(b_ref, o_ref):
    b = b_ref[...]
    o_ref[...] = common.e4m3_to_f32(b) + common.e2m1_to_f32(common.low_nibble(b)) * common.e8m0_to_f32(b)


def _decode(b, interpret):
    return pl.pallas_call(_decode_kernel, out_shape=jax.ShapeDtypeStruct(b.shape, jnp.float32), grid=(1,),
                          in_specs=[pl.BlockSpec(b.shape, lambda i: (0, 0))],
                          out_specs=pl.BlockSpec(b.shape, lambda i: (0, 0)),
                          compiler_params=plt.CompilerParams(num_warps=4), interpret=interpret)(b)


def test_decoders_inside_a_kernel_interpret_and_lowering():
    b = jnp.asarray(np.random.default_rng(0).integers(0, 255, (16, 128)), jnp.uint8)
    got = np.asarray(_decode(b, True))
    ref = np.asarray(common.e4m3_to_f32(b) + common.e2m1_to_f32(common.low_nibble(b)) * common.e8m0_to_f32(b))
    np.testing.assert_array_equal(got, ref)
    text = common.lower_for_h200(lambda x: _decode(x, False), jax.ShapeDtypeStruct((16, 128), jnp.uint8))
    assert "triton" in text


def test_sum_in_order_is_the_loop_sum_in_every_grouping():
    """The grouped, unrolled partial sum adds in index order: bit-identical to the loop's f32 sum (values over 12
    binades, so another order would round differently), and each load is made once."""
    rng = np.random.default_rng(5)
    parts = rng.normal(0, 1, (13, 4, 8)) * 2.0 ** rng.integers(-6, 6, (13, 4, 8))
    parts = jnp.asarray(parts, jnp.float32)
    init = jnp.asarray(rng.normal(0, 1, (4, 8)), jnp.float32)
    want = init
    for k in range(13):
        want = want + parts[k]
    reordered = init + jnp.sum(parts[::-1], axis=0)
    assert not np.array_equal(np.asarray(reordered), np.asarray(want))  # the order matters for these values
    for regs in (1, 5, 13, 64, 1000):
        seen = []
        got = common.sum_in_order(lambda k: seen.append(k) or parts[k], 13, init, regs_per_load=regs)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert seen == list(range(13))
