"""pallas_kernels.moe.grouped_matmul (interpret mode) vs its reference on random bf16 / MXFP4 experts: stacked with
a traced layer, uneven groups with empty experts and padding rows; inactive experts' weights are never read
(poisoning them leaves the output bit-identical); the work list; the H200 lowering of full shapes.

The output buffer is zero-initialised and aliased: rows no program owns must come back 0 (padding rows), and a
row tile that skipped its store would leave zeros that fail the bound against the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from dsv41_jax.params import expert_weight
from pallas_kernels.moe import MoeBlock, grouped_matmul, pick_moe_block, ref_grouped_matmul, tile_metadata
from pallas_kernels.moe.kernel import dequant_mxfp4, max_work_items
from tests.kernels.test_gemm import triton_ir

INTERPRET = jax.default_backend() == "cpu"  # on a GPU (JAX_PLATFORMS=cuda) the kernels run compiled

E, N, K, L = 8, 64, 128, 2
GROUPS = (3, 0, 21, 1, 0, 9, 0, 2)  # 36 rows: empty experts 1, 4, 6; expert 2 spans two 16-row tiles
M = 40  # 4 padding rows


def check_close(y, ref, x, wd, sizes):
    """Rows of each group within 1e-5 * sum_k |x_k w_k| of the reference; padding rows exactly 0."""
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    x, wd = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(wd, np.float64))
    assert y.shape == ref.shape and np.all(np.isfinite(y))
    r = 0
    for g, n in enumerate(sizes):
        bound = x[r:r + n] @ wd[g].T
        err = np.abs(y[r:r + n] - ref[r:r + n])
        assert np.all(err <= 1e-5 * bound + 1e-30), (g, float((err / (bound + 1e-30)).max()))
        r += n
    np.testing.assert_array_equal(y[r:], 0.0)


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.key(11), 3)
    x = jax.random.normal(k[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (L, E, N, K // 32, 32))
    w = (w * jnp.exp2(jax.random.randint(k[2], (L, E, N, K // 32, 1), -5, 3))).reshape(L, E, N, K)
    p, s = quant.quantize_weight_fp4(w)
    return x, w.astype(jnp.bfloat16), p, s


def test_ref_dequant_matches_model(data):
    _, _, p, s = data
    np.testing.assert_array_equal(np.asarray(dequant_mxfp4(p, s), np.float32),
                                  np.asarray(expert_weight({"weight": p, "scale": s}), np.float32))
    assert len(np.unique(np.asarray(p))) > 200  # every nibble pair occurs


@pytest.mark.parametrize("fp4", [False, True])
def test_grouped_stacked_traced_layer(data, fp4):
    x, wb, p, s = data
    gs = jnp.asarray(GROUPS, jnp.int32)
    w, scale = (p, s) if fp4 else (wb, None)
    f = jax.jit(lambda x, w, s, g, l: grouped_matmul(x, w, g, scale=s, layer=l, interpret=INTERPRET,
                                                     block=MoeBlock(16, 32, 64)))
    for layer in (1, 0):
        wd = dequant_mxfp4(p[layer], s[layer]) if fp4 else wb[layer]
        y = f(x, w, scale, gs, jnp.int32(layer))
        check_close(y, ref_grouped_matmul(x, w, gs, scale=scale, layer=jnp.int32(layer)), x, wd, GROUPS)


@pytest.mark.parametrize("fp4", [False, True])
def test_grouped_unstacked_decode_rows(data, fp4):
    """Few rows (< one 16-row tile, as at decode with batch 1): default blocks, groups filling every row."""
    x, wb, p, s = data
    sizes = (1, 2, 0, 0, 1, 1, 0, 1)  # 5 of the 6 work items the static bound allows
    gs = jnp.asarray(sizes, jnp.int32)
    w, scale = (p[1], s[1]) if fp4 else (wb[1], None)
    wd = dequant_mxfp4(p[1], s[1]) if fp4 else wb[1]
    y = grouped_matmul(x[:6], w, gs, scale=scale, interpret=INTERPRET)
    check_close(y, ref_grouped_matmul(x[:6], w, gs, scale=scale), x[:6], wd, sizes)


@pytest.mark.parametrize("fp4", [False, True])
def test_inactive_experts_never_read(data, fp4):
    """Poison every inactive expert (NaN bf16 / random bytes and scales): output bit-identical and finite."""
    x, wb, p, s = data
    gs = jnp.asarray(GROUPS, jnp.int32)
    inactive = np.asarray(GROUPS) == 0
    blk = MoeBlock(16, 32, 64)
    if fp4:
        w, scale = p[0], jax.lax.bitcast_convert_type(s[0], jnp.uint8)
        rng = np.random.default_rng(0)
        wp = np.asarray(w).copy()
        sp = np.asarray(scale).copy()
        wp[inactive] = rng.integers(0, 256, wp[inactive].shape)
        sp[inactive] = 255  # NaN scale code
        poisoned = dict(w=jnp.asarray(wp), scale=jnp.asarray(sp))
        clean = dict(w=w, scale=scale)
    else:
        w = wb[0]
        poisoned = dict(w=jnp.where(jnp.asarray(inactive)[:, None, None], jnp.nan, w).astype(jnp.bfloat16))
        clean = dict(w=w)
    y0 = np.asarray(grouped_matmul(x, group_sizes=gs, interpret=INTERPRET, block=blk, **clean))
    y1 = np.asarray(grouped_matmul(x, group_sizes=gs, interpret=INTERPRET, block=blk, **poisoned))
    assert np.all(np.isfinite(y1))
    np.testing.assert_array_equal(y1, y0)
    # the poison is visible to a kernel that reads every expert (the reference)
    assert not np.all(np.isfinite(np.asarray(ref_grouped_matmul(x, group_sizes=gs, **poisoned))))


def test_items_derived_in_kernel_equal_the_work_list():
    """Each program's entry derived from the padded sizes (worklist._item_from_sizes, what the kernels do when the
    sizes are traced) equals tile_metadata's row, for random sizes (padding rows, empty experts, M < bm), in a
    Pallas kernel (interpret mode on CPU) and through the H200 lowering."""
    from jax.experimental import pallas as pl

    from pallas_kernels import common
    from pallas_kernels.moe import worklist

    def derive(sizes, m, bm, n_items, interpret):
        def kern(s_ref, o_ref):
            fields = worklist._item_from_sizes(s_ref[...], pl.program_id(0), m, bm)
            col = jax.lax.broadcasted_iota(jnp.int32, (1, 4), 1)
            o_ref[...] = sum(jnp.where(col == f, v, 0) for f, v in enumerate(fields))
        return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((n_items, 4), jnp.int32), grid=(n_items,),
                              in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                              out_specs=pl.BlockSpec((1, 4), lambda t: (t, 0)), interpret=interpret)(sizes)

    rng = np.random.default_rng(5)
    for trial in range(12):
        n_e, m, bm = (10, 150, 16), (16, 40, 32), (5, 3, 16)
        n_e, m, bm = (n_e, m, bm)[trial % 3]
        sizes = rng.integers(0, 30, n_e) * (rng.random(n_e) < 0.6)
        sizes = np.minimum(sizes, m // max(1, n_e // 2))
        n_items = max_work_items(m, n_e, bm)
        _, padded = worklist.meta(jnp.asarray(sizes, jnp.int32), m, n_e, MoeBlock(bm, 32, 64))
        assert padded.shape[0] & (padded.shape[0] - 1) == 0 and padded.shape[0] >= n_e
        want = np.asarray(tile_metadata(jnp.asarray(sizes, jnp.int32), m, bm, n_items))
        got = np.asarray(derive(padded, m, bm, n_items, True))
        np.testing.assert_array_equal(got, want, err_msg=f"sizes={sizes} m={m} bm={bm}")
    text = common.lower_for_h200(lambda s: derive(s, 48, 16, 19, False), jax.ShapeDtypeStruct((16,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text


def test_work_list_covers_active_rows_once():
    rng = np.random.default_rng(3)
    n_e, m = 10, 150
    meta_fn = jax.jit(tile_metadata, static_argnums=(1, 2, 3))
    for trial in range(24):
        bm = (16, 32)[trial % 2]
        sizes = rng.integers(0, 30, n_e) * (rng.random(n_e) < 0.6)
        sizes[rng.integers(0, n_e)] += m - sizes.sum() if trial % 3 == 0 else 0  # sometimes no padding rows
        n_items = max_work_items(m, n_e, bm)
        meta = np.asarray(meta_fn(jnp.asarray(sizes, jnp.int32), m, bm, n_items))
        owner = np.full(m, -1)
        for e, r0, lo, hi in meta:
            if hi <= lo:
                continue
            assert sizes[e] > 0 and 0 <= r0 <= lo < hi <= r0 + bm <= m and hi - lo <= bm
            assert np.all(owner[lo:hi] == -1)
            owner[lo:hi] = e
        assert np.array_equal(owner[:sizes.sum()], np.repeat(np.arange(n_e), sizes)), trial
        assert np.all(owner[sizes.sum():] == -1)
        assert (meta[:, 3] > meta[:, 2]).sum() == sum(-(-n // bm) for n in sizes)


def test_xla_branch_and_bad_args(data):
    x, wb, p, s = data
    gs = jnp.asarray(GROUPS, jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(grouped_matmul(x, p, gs, scale=s, layer=1, implementation="xla")),
        np.asarray(ref_grouped_matmul(x, p, gs, scale=s, layer=1)))
    with pytest.raises(ValueError):
        grouped_matmul(x, wb, gs)  # stacked without layer
    with pytest.raises(ValueError):
        grouped_matmul(x, wb[0], gs[:4])


def _sd(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("M_,Nf,Kf,stack", [(48, 2304, 5120, ()), (48, 5120, 2304, ()), (192, 2304, 5120, (2,)),
                                            (8192, 5120, 2304, ())])
def test_full_shape_lowering(fp4, M_, Nf, Kf, stack):
    """E=384 experts (w1/w3 and w2 shapes), optionally stacked over layers: lowers for the H200 with no slice of
    the weights outside the kernel; a single layer's MXFP4 experts (2.1 GiB of bytes) get 64-bit offsets."""
    w = _sd((*stack, 384, Nf, Kf // 2), jnp.uint8) if fp4 else _sd((*stack, 384, Nf, Kf), jnp.bfloat16)
    s = _sd((*stack, 384, Nf, Kf // 32), jnp.float8_e8m0fnu) if fp4 else None
    layer = _sd((), jnp.int32) if stack else None
    fn = lambda x, w, s, g, l: grouped_matmul(x, w, g, scale=s, layer=l, interpret=False)  # noqa: E731
    irs = triton_ir(fn, _sd((M_, Kf), jnp.bfloat16), w, s, _sd((384,), jnp.int32), layer)
    assert len(irs) == 1
    blk = pick_moe_block(M_, Nf, Kf, fp4=fp4, active=min(M_, 384))
    tile = f"tensor<{blk.bn}x{blk.bk // 2 if fp4 else blk.bk}x!tt.ptr<{'i8' if fp4 else 'bf16'}>>"
    wloads = [ln for ln in irs[0].splitlines() if "tt.addptr" in ln and tile in ln]
    assert len(wloads) == 1, wloads  # the weight tile
    if fp4 or stack:  # > 2^31 elements: the weight offsets must be 64-bit
        assert all("xi64>" in ln for ln in wloads), wloads


def test_grouped_many_rows_per_expert(data):
    """Prefill-like: ~50 rows per expert -> 64-row tiles, an expert spanning two tiles, 9 padding rows."""
    _, wb, p, s = data
    sizes = (90, 0, 70, 31, 0, 0, 0, 0)
    x = jax.random.normal(jax.random.key(2), (200, K), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    y = grouped_matmul(x, p, gs, scale=s, layer=1, interpret=INTERPRET, block=MoeBlock(64, 64, 128))
    check_close(y, ref_grouped_matmul(x, p, gs, scale=s, layer=1), x, dequant_mxfp4(p[1], s[1]), sizes)


def test_wrapper_has_no_serial_loop():
    """The work list is built without while loops / scans (a GPU while loop syncs with the host per iteration)."""
    from pallas_kernels import common

    fn = lambda x, w, g: grouped_matmul(x, w, g, interpret=False)  # noqa: E731
    text = common.lower_for_h200(fn, _sd((48, 256), jnp.bfloat16), _sd((384, 64, 256), jnp.bfloat16),
                                 _sd((384,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in text
    assert "stablehlo.while" not in text and "chlo.scan" not in text


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="compiled kernel: GPU only (JAX_PLATFORMS=cuda)")
@pytest.mark.parametrize("fp4", [False, True])
def test_compiled_on_gpu(data, fp4):
    """The Triton-compiled kernel (not interpret mode): uneven groups, decode rows, poisoned inactive experts."""
    x, wb, p, s = data
    w, scale = (p, s) if fp4 else (wb, None)
    wd = dequant_mxfp4(p[1], s[1]) if fp4 else wb[1]
    for sizes, m in ((GROUPS, M), ((1, 2, 0, 0, 1, 1, 0, 1), 6)):
        gs = jnp.asarray(sizes, jnp.int32)
        for blk in (None, MoeBlock(16, 32, 64)):
            y = jax.jit(lambda x, w, s, g, l: grouped_matmul(x, w, g, scale=s, layer=l, interpret=False, block=blk))(
                x[:m], w, scale, gs, jnp.int32(1))
            check_close(y, ref_grouped_matmul(x[:m], w, gs, scale=scale, layer=1), x[:m], wd, sizes)
    inactive = jnp.asarray(np.asarray(GROUPS) == 0)
    if fp4:
        poisoned = dict(w=jnp.where(inactive[None, :, None, None], jnp.uint8(0x77), p),
                        scale=jnp.where(inactive[None, :, None, None], jnp.uint8(255),
                                        jax.lax.bitcast_convert_type(s, jnp.uint8)))
    else:
        poisoned = dict(w=jnp.where(inactive[None, :, None, None], jnp.nan, wb).astype(jnp.bfloat16))
    gs = jnp.asarray(GROUPS, jnp.int32)
    y0 = grouped_matmul(x, w, gs, scale=scale, layer=1, interpret=False)
    y1 = grouped_matmul(x, group_sizes=gs, layer=1, interpret=False, **poisoned)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))


@pytest.mark.parametrize("splits", [1, 2])
def test_tiled_layout_split(data, splits):
    """Weights re-laid out at load (checkpoints.kernel_layout, tiled for bk=128): same result as the official
    layout; split K (f32 partials summed)."""
    from checkpoints.kernel_layout import to_tiled_mxfp4

    x, _, p, s = data
    gs = jnp.asarray(GROUPS, jnp.int32)
    ref = ref_grouped_matmul(x, p, gs, scale=s, layer=1)
    for layout, w in (("official", p), ("tiled", to_tiled_mxfp4(p, 128))):
        blk = MoeBlock(16, 32, 128, splits=1 if K // 128 < splits else splits, layout=layout)
        y = grouped_matmul(x, w, gs, scale=s, layer=1, interpret=INTERPRET, block=blk)
        check_close(y, ref, x, dequant_mxfp4(p[1], s[1]), GROUPS)
    blk = MoeBlock(16, 32, 64, splits=2)
    y = grouped_matmul(x, p, gs, scale=s, layer=1, interpret=INTERPRET, block=blk)
    check_close(y, ref, x, dequant_mxfp4(p[1], s[1]), GROUPS)


@pytest.mark.parametrize("splits,limit", [(1, 0.0), (2, 1.5)])
def test_grouped_swiglu_fused(data, splits, limit):
    """w1 / w3 / SwiGLU / routing weight in one kernel vs the model's sequence of ops (layers.routed_experts):
    g and u rounded to bf16 first, so h agrees to one bf16 rounding of the activation (exp differs)."""
    from pallas_kernels.moe import grouped_swiglu, ref_grouped_swiglu

    x, _, p, s = data
    gs = jnp.asarray(GROUPS, jnp.int32)
    rw = jax.random.uniform(jax.random.key(5), (M,), jnp.float32, 0.05, 1.0)
    w1, w3, s1, s3 = p[0], p[1], s[0], s[1]
    blk = MoeBlock(16, 32, 64, splits=splits)
    h = grouped_swiglu(x, w1, w3, gs, rw, scale1=s1, scale3=s3, limit=limit, interpret=INTERPRET, block=blk)
    ref = ref_grouped_swiglu(x, w1, w3, gs, rw, scale1=s1, scale3=s3, limit=limit)
    assert h.dtype == jnp.bfloat16 and h.shape == (M, N)
    h, ref = np.asarray(h, np.float64), np.asarray(ref, np.float64)
    n = sum(GROUPS)
    np.testing.assert_array_equal(h[n:], 0.0)
    assert np.all(np.isfinite(h))
    np.testing.assert_allclose(h[:n], ref[:n], rtol=2 ** -7, atol=1e-6 * np.abs(ref).max())
    assert np.mean(h[:n] == ref[:n]) > 0.95 and np.abs(ref[:n]).max() > 0.1
    if limit:
        assert np.any(np.abs(ref[:n]) > 0) and np.max(np.asarray(
            ref_grouped_matmul(x, w3, gs, scale=s3))[:n]) > limit  # the clip is exercised


@pytest.mark.parametrize("fp4", [False, True])
def test_static_group_sizes_give_a_constant_work_list(data, fp4):
    """Group sizes known at trace time (a numpy array, as WO-A's G groups of B*T rows): the same result as traced
    sizes, and the work list is a constant of the program; traced sizes go to the kernel as they are (each program
    derives its item): neither builds the list in XLA (no comparisons / sums of the sizes outside the kernel)."""
    from pallas_kernels import common

    x, wb, p, s = data
    w, scale = (p, s) if fp4 else (wb, None)
    blk = MoeBlock(16, 32, 64)

    def run(g):
        return jax.jit(lambda x, w, s: grouped_matmul(x, w, g, scale=s, layer=jnp.int32(1), interpret=INTERPRET,
                                                      block=blk))(x, w, scale)

    want = run(jnp.asarray(GROUPS, jnp.int32))
    got = run(np.asarray(GROUPS, np.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    wd = dequant_mxfp4(p[1], s[1]) if fp4 else wb[1]
    check_close(got, ref_grouped_matmul(x, w, jnp.asarray(GROUPS), scale=scale, layer=jnp.int32(1)), x, wd, GROUPS)

    def lowered(g):
        return common.lower_for_h200(lambda x, w: grouped_matmul(x, w, g, interpret=False, block=blk),
                                     _sd((M, K), jnp.bfloat16), _sd((E, N, K), jnp.bfloat16))

    traced = common.lower_for_h200(lambda x, w, g: grouped_matmul(x, w, g, interpret=False, block=blk),
                                   _sd((M, K), jnp.bfloat16), _sd((E, N, K), jnp.bfloat16), _sd((E,), jnp.int32))
    static = lowered(np.asarray(GROUPS, np.int32))
    assert "stablehlo.compare" not in traced and "stablehlo.compare" not in static
    table = f"tensor<{max_work_items(M, E, blk.bm)}x4xi32>"
    assert table in static and table not in traced
