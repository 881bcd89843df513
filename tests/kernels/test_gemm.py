"""pallas_kernels.gemm.matmul (interpret mode) vs its reference on random bf16 / FP8 block-32 weights, plain and
stacked with a traced layer (jit, lax.scan), M in {1, 5, 16, 40}, split K; the H200 lowering of full shapes.

Interpret mode fills output blocks that a kernel never writes with NaN, so an unwritten tile fails the bound."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from dsv41_jax.params import lin_weight
from pallas_kernels import common
from pallas_kernels.common import _widen_for_offsets
from pallas_kernels.gemm import GemmBlock, matmul, ref_matmul
from pallas_kernels.gemm.kernel import dequant_fp8

INTERPRET = jax.default_backend() == "cpu"  # on a GPU (JAX_PLATFORMS=cuda) the kernels run compiled

N, K, L = 64, 128, 3
MS = (1, 5, 16, 40)


def triton_ir(fn, *abstract_args) -> list[str]:
    """Triton IR text of every Pallas kernel in fn, lowered for the H200 (common.lower_for_h200)."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import triton as tlib
    from jax._src.lib.mlir import ir

    ctx = jmlir.make_ir_context()
    tlib.dialect.register_dialect(ctx)
    module = ir.Module.parse(common.lower_for_h200(fn, *abstract_args), context=ctx)
    out = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if o.operation.name == "stablehlo.custom_call":
                        cfg = o.attributes["mhlo.backend_config"]
                        out.append(str(ir.Module.parse(cfg["ir"].value_bytes, context=ctx)))
                    walk(o.operation)

    walk(module.operation)
    return out


def check_close(y, ref, x, wd):
    """|y - ref| <= 1e-5 * sum_k |x_k w_k| (+ f32 denormal slack): products exact, only summation order differs."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    bound = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(wd, np.float64)).T
    assert y.shape == ref.shape and np.all(np.isfinite(y))
    err = np.abs(y - ref)
    assert np.all(err <= 1e-5 * bound + 1e-30), float((err / (bound + 1e-30)).max())


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(k[0], (max(MS), K), jnp.float32).astype(jnp.bfloat16)
    # magnitudes spread over several binades, so the FP8 tiles get different scales
    w = jax.random.normal(k[1], (L, N // 32, 32, K // 32, 32))
    w = (w * jnp.exp2(jax.random.randint(k[2], (L, N // 32, 1, K // 32, 1), -6, 4))).reshape(L, N, K)
    q, s = quant.quantize_weight_fp8(w)
    return x, w.astype(jnp.bfloat16), q, s


def test_ref_dequant_matches_model(data):
    _, _, q, s = data
    np.testing.assert_array_equal(np.asarray(dequant_fp8(q, s), np.float32),
                                  np.asarray(lin_weight({"weight": q, "scale": s}), np.float32))
    assert len(np.unique(np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8)))) > 4


@pytest.mark.parametrize("M", MS)
def test_matmul_bf16_plain(data, M):
    x, wb, _, _ = data
    x = x[:M]
    y = matmul(x, wb[1], interpret=INTERPRET)
    check_close(y, ref_matmul(x, wb[1]), x, wb[1])
    if M == 5:  # split K (4 partial sums) and small tiles
        y = matmul(x, wb[1], interpret=INTERPRET, block=GemmBlock(16, 16, 32, 4))
        check_close(y, ref_matmul(x, wb[1]), x, wb[1])


@pytest.mark.parametrize("M", MS)
def test_matmul_fp8_stacked_traced_layer(data, M):
    x, _, q, s = data
    x = x[:M]
    blk = GemmBlock(16, 32, 32, 2) if M in (5, 40) else None
    f = jax.jit(lambda x, q, s, l: matmul(x, q, scale=s, layer=l, interpret=INTERPRET, block=blk))
    for layer in (2, 0):
        wd = dequant_fp8(q[layer], s[layer])
        y = f(x, q, s, jnp.int32(layer))
        check_close(y, ref_matmul(x, q, scale=s, layer=jnp.int32(layer)), x, wd)
        # raw uint8 scale codes are accepted too
        y2 = matmul(x, q, scale=jax.lax.bitcast_convert_type(s, jnp.uint8), layer=layer, interpret=INTERPRET, block=blk)
        np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))


@pytest.mark.parametrize("fp8", [False, True])
def test_matmul_inside_scan_over_layers(data, fp8):
    x, wb, q, s = data
    x = x[:5]
    w, scale = (q, s) if fp8 else (wb, None)

    @jax.jit
    def run(x, w, scale):
        def step(h, l):
            return h, matmul(x, w, scale=scale, layer=l, interpret=INTERPRET)
        return jax.lax.scan(step, 0, jnp.arange(L, dtype=jnp.int32))[1]

    ys = run(x, w, scale)
    for l in range(L):
        wd = dequant_fp8(q[l], s[l]) if fp8 else wb[l]
        check_close(ys[l], ref_matmul(x, wd), x, wd)


def test_matmul_xla_branch_and_bad_args(data):
    x, wb, q, s = data
    np.testing.assert_array_equal(np.asarray(matmul(x, q, scale=s, layer=1, implementation="xla")),
                                  np.asarray(ref_matmul(x, q, scale=s, layer=1)))
    with pytest.raises(ValueError):
        matmul(x, wb)  # stacked without layer
    with pytest.raises(ValueError):
        matmul(x, wb[0], layer=0)
    with pytest.raises(ValueError):
        matmul(x, wb[0], block=GemmBlock(16, 48, 32))


def _sd(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("M,Nf,Kf", [(8, 5120, 5120), (8, 32768, 1280), (32, 5120, 8192), (2048, 2304, 5120)])
def test_full_shape_lowering(fp8, M, Nf, Kf):
    """Stacked [4, N, K] weight, layer read in the kernel: lowers for the H200 with no slice of the stack."""
    args = [_sd((M, Kf), jnp.bfloat16), _sd((4, Nf, Kf), jnp.float8_e4m3fn if fp8 else jnp.bfloat16),
            _sd((4, Nf // 32, Kf // 32), jnp.float8_e8m0fnu) if fp8 else None, _sd((), jnp.int32)]
    fn = lambda x, w, s, l: matmul(x, w, scale=s, layer=l, interpret=False)  # noqa: E731
    text = common.lower_for_h200(fn, *args)
    assert "__gpu$xla.gpu.triton" in text
    assert "dynamic_slice" not in text and "gather" not in text  # the stack is never sliced outside the kernel


def test_offset_fix_widens_only_large_byte_arrays():
    """One layer's MXFP4 experts (2.1 GiB of uint8) must be indexed with 64-bit offsets on the GPU."""
    from jax._src.pallas.triton import lowering as tl

    def info(shape, dtype):
        return tl.BlockInfo(jax.core.ShapedArray(shape, jnp.dtype(dtype)), (), (), ())

    assert _widen_for_offsets(info((384, 2304, 2560), jnp.uint8)).full_shape_dtype.dtype == jnp.uint16
    for shape, dtype in (((384, 2304, 128), jnp.uint8), ((384, 2304, 2560), jnp.bfloat16)):
        assert _widen_for_offsets(info(shape, dtype)).full_shape_dtype.dtype == jnp.dtype(dtype)


def test_matmul_fp8_prefill_rows(data):
    """M = 130 (not a multiple of the 64-row tile): three M tiles, the last one mostly padding."""
    _, _, q, s = data
    x = jax.random.normal(jax.random.key(1), (130, K), jnp.float32).astype(jnp.bfloat16)
    y = matmul(x, q, scale=s, layer=jnp.int32(1), interpret=INTERPRET)
    wd = dequant_fp8(q[1], s[1])
    check_close(y, ref_matmul(x, wd), x, wd)


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="compiled kernel: GPU only (JAX_PLATFORMS=cuda)")
@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_on_gpu(data, fp8):
    """The Triton-compiled kernel (not interpret mode) at small shapes, default and split-K tiles."""
    x, wb, q, s = data
    w, scale = (q, s) if fp8 else (wb, None)
    for M in MS + (130,):
        xm = jnp.tile(x, (4, 1))[:M]
        for blk in (None, GemmBlock(16, 32, 32, 2)):
            y = jax.jit(lambda x, w, s, l: matmul(x, w, scale=s, layer=l, interpret=False, block=blk))(
                xm, w, scale, jnp.int32(2))
            wd = dequant_fp8(q[2], s[2]) if fp8 else wb[2]
            check_close(y, ref_matmul(xm, wd), xm, wd)
