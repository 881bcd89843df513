"""The FP8 x FP8 weight GEMMs (pallas_kernels/gemm/fp8_kernel.py, pallas_kernels/moe/fp8_kernel.py, shared pieces in
pallas_kernels/fp8dot.py) in interpret mode against their references on random inputs: FP8 block-32 linears and
MXFP4 experts with FP8 activations (x E4M3 codes + UE8M0 scales), block-diagonal rows (R * nb = 16 / 32), swapped
dots, split K, stacked weights with a traced layer, uneven groups with padding rows (which must come back 0) and
poisoned inactive experts; the TUNED tables (an FP8-dot block is picked only for FP8 activations, R resized); the ops
seam with FP8-dot blocks against the XLA reference ops (a cheap stand-in for the engine test, which runs the default
blocks); the H200 lowering of full shapes (FAST_ACCUM dots carry
max_num_imprecise_acc; 64-bit offsets into a layer's 2.1 GiB of MXFP4 bytes).

Interpret mode computes the FP8 dots exactly in f32, so the bound is the exact-path one (1e-5 * sum |x w|); the
FAST_ACCUM wgmma's own error is measured on the GPU by bench/weight_gemms.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import quant
from pallas_kernels.gemm import GemmBlock, matmul, ref_matmul
from pallas_kernels.gemm import block_sizes as gemm_bs
from pallas_kernels.gemm.kernel import dequant_fp8, dequant_x
from pallas_kernels.moe import MoeBlock, grouped_matmul, grouped_swiglu, ref_grouped_matmul, ref_grouped_swiglu
from pallas_kernels.moe import block_sizes as moe_bs
from pallas_kernels.moe.kernel import dequant_mxfp4
from tests.kernels.test_gemm import triton_ir

INTERPRET = jax.default_backend() == "cpu"
E, N, K, L = 8, 64, 256, 2
GROUPS = (3, 0, 21, 1, 0, 9, 0, 2)  # 36 rows, 4 padding rows; empty experts 1, 4, 6
M = 40


def fp8_rows(key, m, k):
    """FP8-per-32 activations spread over binades: (bf16 values, E4M3 codes, UE8M0 codes)."""
    k1, k2 = jax.random.split(key)
    e = jax.random.randint(k2, (m, k // 32, 1), -4, 4)
    x = jax.random.normal(k1, (m, k)) * jnp.exp2(e).repeat(32, -1).reshape(m, k)
    q, c = quant.fp8_encode(x, 32)
    return quant.fp8_decode(q, c, 32, jnp.bfloat16), q, c


def bound_check(y, ref, x, wd, rows=None, fast: bool = False):
    """|y - ref| <= tol * sum_k |x_k w_k| per row (rows: (group sizes) -> per-expert weights; then padding rows 0);
    tol = 1e-5, or the FAST_ACCUM bound 2^-9 when such a block runs compiled (GPU)."""
    tol = 2.0 ** -9 if fast and not INTERPRET else 1e-5
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    x, wd = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(wd, np.float64))
    assert y.shape == ref.shape and np.all(np.isfinite(y))
    if rows is None:
        b = x @ wd.T
        assert np.all(np.abs(y - ref) <= tol * b + 1e-30)
        return
    r = 0
    for g, n in enumerate(rows):
        b = x[r:r + n] @ wd[g].T
        assert np.all(np.abs(y[r:r + n] - ref[r:r + n]) <= tol * b + 1e-30), g
        r += n
    np.testing.assert_array_equal(y[r:], 0.0)


@pytest.fixture(scope="module")
def dense():
    k = jax.random.split(jax.random.key(21), 2)
    w = jax.random.normal(k[0], (L, 128, K)) * jnp.exp2(jax.random.randint(k[1], (L, 4, 1, K // 32, 1), -6, 4)
                                                        ).repeat(32, 2).repeat(32, 4).reshape(L, 128, K)
    return quant.quantize_weight_fp8(w)


@pytest.mark.parametrize("m,blk", [
    (1, GemmBlock(2, 64, 256, decode="fp8", nb=8, swap=True, fast_accum=True)),
    (5, GemmBlock(8, 32, 64, 2, decode="fp8", nb=2)),
    (40, GemmBlock(64, 64, 128, 2, decode="fp8", nb=1, swap=True)),
    (40, GemmBlock(16, 128, 64, decode="fp8", nb=2)),  # 32-row MMA, three M tiles
    (5, GemmBlock(8, 32, 64, 2, decode="fp8", nb=2, prefetch=True)),  # small loads one step ahead
    (3, GemmBlock(8, 32, 128, decode="fp8", nb=2, swap=True, prefetch=True)),  # two dots a step, two steps
])
def test_dense_fp8_dot(dense, m, blk):
    q, s = dense
    xb, xq, xc = fp8_rows(jax.random.key(m), m, K)
    f = jax.jit(lambda x, xs, lyr: matmul(x, q, scale=s, layer=lyr, x_scale=xs, block=blk, interpret=INTERPRET))
    for layer in (1, 0):
        y = f(xq, xc, jnp.int32(layer))
        bound_check(y, ref_matmul(xb, q, scale=s, layer=layer), xb, dequant_fp8(q[layer], s[layer]),
                    fast=blk.fast_accum)
    np.testing.assert_array_equal(np.asarray(dequant_x(xq, xc), np.float32), np.asarray(xb, np.float32))


def test_dense_tuned_pick(dense, monkeypatch):
    """A TUNED FP8-dot entry is used for FP8 activations only (R resized to M); the bf16 path ignores it."""
    q, s = dense
    monkeypatch.setitem(gemm_bs.TUNED, (128, K, 8), GemmBlock(8, 32, 64, decode="fp8", nb=2))
    picked = gemm_bs.pick_gemm_block(3, 128, K, fp8=True, x_fp8=True)
    assert (picked.decode, picked.bm, picked.nb, picked.bm * picked.nb) == ("fp8", 4, 4, 16)
    assert gemm_bs.pick_gemm_block(3, 128, K, fp8=True).decode != "fp8"
    assert gemm_bs.pick_gemm_block(9, 128, K, fp8=True, x_fp8=True).decode != "fp8"  # no entry >= 9
    xb, xq, xc = fp8_rows(jax.random.key(3), 3, K)
    y = matmul(xq, q[1], scale=s[1], x_scale=xc, interpret=INTERPRET)
    bound_check(y, ref_matmul(xb, q[1], scale=s[1]), xb, dequant_fp8(q[1], s[1]))


@pytest.fixture(scope="module")
def experts():
    k = jax.random.split(jax.random.key(11), 3)
    w = jax.random.normal(k[1], (L, E, N, K // 32, 32))
    w = (w * jnp.exp2(jax.random.randint(k[2], (L, E, N, K // 32, 1), -5, 3))).reshape(L, E, N, K)
    p, s = quant.quantize_weight_fp4(w)
    return p, s, fp8_rows(k[0], M, K)


@pytest.mark.parametrize("blk", [MoeBlock(2, 32, 256, decode="fp8", nb=8, swap=True, fast_accum=True),
                                 MoeBlock(8, 64, 64, splits=2, decode="fp8", nb=2),
                                 MoeBlock(4, 32, 256, decode="fp8", nb=8),  # 32-row MMA
                                 MoeBlock(8, 64, 64, splits=2, decode="fp8", nb=2, prefetch=True),
                                 MoeBlock(8, 32, 128, decode="fp8", nb=2, swap=True, prefetch=True)])
def test_grouped_fp8_dot(experts, blk):
    p, s, (xb, xq, xc) = experts
    gs = jnp.asarray(GROUPS, jnp.int32)
    f = jax.jit(lambda x, xs, lyr: grouped_matmul(x, p, gs, scale=s, layer=lyr, x_scale=xs, block=blk,
                                                  interpret=INTERPRET))
    y = f(xq, xc, jnp.int32(1))
    bound_check(y, ref_grouped_matmul(xb, p, gs, scale=s, layer=1), xb, dequant_mxfp4(p[1], s[1]), GROUPS,
                fast=blk.fast_accum)


def test_grouped_fp8_inactive_experts_never_read(experts):
    p, s, (xb, xq, xc) = experts
    gs = jnp.asarray(GROUPS, jnp.int32)
    inactive = np.asarray(GROUPS) == 0
    wp, sp = np.asarray(p[0]).copy(), np.asarray(jax.lax.bitcast_convert_type(s[0], jnp.uint8)).copy()
    wp[inactive] = np.random.default_rng(0).integers(0, 256, wp[inactive].shape)
    sp[inactive] = 255
    blk = MoeBlock(2, 32, 256, decode="fp8", nb=8, swap=True)
    y0 = grouped_matmul(xq, p[0], gs, scale=s[0], x_scale=xc, block=blk, interpret=INTERPRET)
    y1 = grouped_matmul(xq, jnp.asarray(wp), gs, scale=jnp.asarray(sp), x_scale=xc, block=blk, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
    bound_check(y0, ref_grouped_matmul(xb, p[0], gs, scale=s[0]), xb, dequant_mxfp4(p[0], s[0]), GROUPS)


@pytest.mark.parametrize("blk", [MoeBlock(2, 32, 256, decode="fp8", nb=8, swap=True),
                                 MoeBlock(4, 64, 128, splits=2, decode="fp8", nb=4),
                                 MoeBlock(8, 32, 128, decode="fp8", nb=2, swap=True, prefetch=True)])
def test_grouped_swiglu_fp8_dot(experts, blk):
    """w1 / w3 / SwiGLU / routing weight fused: within one bf16 rounding of the model's sequence of ops."""
    p, s, (xb, xq, xc) = experts
    gs = jnp.asarray(GROUPS, jnp.int32)
    rw = jax.random.uniform(jax.random.key(5), (M,), jnp.float32, 0.05, 1.0)
    h = grouped_swiglu(xq, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.5, x_scale=xc, block=blk,
                       interpret=INTERPRET)
    ref = ref_grouped_swiglu(xb, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.5)
    assert h.dtype == jnp.bfloat16 and h.shape == (M, N)
    h, ref = np.asarray(h, np.float64), np.asarray(ref, np.float64)
    n = sum(GROUPS)
    np.testing.assert_array_equal(h[n:], 0.0)
    np.testing.assert_allclose(h[:n], ref[:n], rtol=2 ** -7, atol=1e-6 * np.abs(ref).max())
    assert np.mean(h[:n] == ref[:n]) > 0.95 and np.abs(ref[:n]).max() > 0.1


def test_moe_tuned_pick(monkeypatch):
    """R follows the expected rows per active expert; a tiled entry never serves official weights."""
    monkeypatch.setattr(moe_bs, "TUNED", {})  # these entries alone (not the measured table)
    blk = MoeBlock(1, 64, 512, decode="fp8", nb=16, swap=True, fast_accum=True)
    monkeypatch.setitem(moe_bs.TUNED, ("swiglu", 2304, 5120, 48), blk)
    monkeypatch.setitem(moe_bs.TUNED, ("gmm", 5120, 2304, 48), MoeBlock(16, 64, 256, layout="tiled"))
    b = moe_bs.pick_moe_block(48, 2304, 5120, fp4=True, active=16, fused=True, x_fp8=True)
    assert (b.decode, b.bm, b.nb, b.bk) == ("fp8", 4, 4, 512)
    assert moe_bs.pick_moe_block(6, 2304, 5120, fp4=True, active=6, fused=True, x_fp8=True) == blk
    assert moe_bs.pick_moe_block(6, 2304, 5120, fp4=True, active=6, fused=True).decode == "bf16x2"
    assert moe_bs.pick_moe_block(6, 5120, 2304, fp4=True, active=6).layout == "official"


@pytest.mark.parametrize("n, in_kernels", [(6, True), (10, False)])  # x quantised in the kernels / by XLA
def test_ops_seam_with_fp8_blocks(monkeypatch, n, in_kernels):
    """ops.linear / ops.routed_experts (Pallas, FP8-dot blocks from TUNED) against the XLA reference ops on a small
    FP8 / MXFP4 layer: the linear within one bf16 rounding; the experts' output (h re-quantized to FP8 between the
    GEMMs, as in the reference, so a flipped bf16 rounding of h can move an FP8 code) close in norm, most entries
    within one bf16 rounding."""
    from dsv41_jax import layers, ops
    from dsv41_jax.config import ModelConfig

    monkeypatch.setattr(ops, "QUANTIZE_X_MAX_TOKENS", n if in_kernels else 0)  # the two cases take the two paths
    cfg = ModelConfig.preset("tiny")
    D, inter, e = 128, 64, cfg.n_routed_experts
    k = jax.random.split(jax.random.key(8), 6)
    lin_q, lin_s = quant.quantize_weight_fp8(jax.random.normal(k[0], (96, D)) * 0.05)
    ws = [quant.quantize_weight_fp4(jax.random.normal(k[i], shape) * 0.1)
          for i, shape in ((1, (e, inter, D)), (2, (e, D, inter)), (3, (e, inter, D)))]
    p = {n: {"weight": w, "scale": sc} for n, (w, sc) in zip(("w1", "w2", "w3"), ws)}
    x = jax.random.normal(k[4], (n, D), jnp.float32).astype(jnp.bfloat16)
    idx = jnp.stack([jax.random.permutation(jax.random.fold_in(k[5], t), e)[:cfg.n_activated_experts]
                     for t in range(n)])
    wts = jax.random.uniform(k[5], idx.shape, jnp.float32, 0.1, 1.0)
    monkeypatch.setitem(gemm_bs.TUNED, (96, D, 16), GemmBlock(16, 32, 128, decode="fp8", nb=1, swap=True))
    rows = n * cfg.n_activated_experts
    monkeypatch.setitem(moe_bs.TUNED, ("swiglu", inter, D, rows), MoeBlock(4, 32, 128, decode="fp8", nb=4))
    monkeypatch.setitem(moe_bs.TUNED, ("gmm", D, inter, rows), MoeBlock(8, 32, 64, decode="fp8", nb=2, swap=True))
    pal = ops.ExecContext(kernels="pallas")
    lp = {"weight": lin_q, "scale": lin_s}
    y, ref = ops.linear(pal, cfg, lp, x), layers.linear(cfg, lp, x)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=2 ** -7,
                               atol=1e-5 * float(jnp.abs(ref.astype(jnp.float32)).max()))
    y, ref = (np.asarray(f(cfg, p, x, wts, idx), np.float64) for f in
              (lambda *a: ops.routed_experts(pal, *a), layers.routed_experts))
    assert np.all(np.isfinite(y)) and np.abs(ref).max() > 0.01
    assert np.linalg.norm(y - ref) <= 2e-2 * np.linalg.norm(ref)
    assert np.mean(np.abs(y - ref) <= 2 ** -7 * np.abs(ref) + 1e-6) > 0.9
    # expert ids out of range (DEP's padding rows) route nowhere: their rows are left undefined by the kernels (no
    # zeroed buffers; NaN in interpret mode) and must not reach any token
    idx_pad = idx.at[n - 3:].set(e).at[3, 1].set(e)
    y, ref = (np.asarray(f(cfg, p, x, wts, idx_pad), np.float64) for f in
              (lambda *a: ops.routed_experts(pal, *a), layers.routed_experts))
    assert np.all(np.isfinite(y)) and np.all(ref[n - 3:] == 0) and np.all(y[n - 3:] == 0)
    assert np.linalg.norm(y - ref) <= 2e-2 * np.linalg.norm(ref)


def _sd(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_full_shape_lowering():
    """FP8-dot kernels at the full model's shapes lower for the H200: FAST_ACCUM dots carry max_num_imprecise_acc
    = K; the weight tile loads of a layer's MXFP4 experts (2.1 GiB) use 64-bit offsets."""
    blk = GemmBlock(1, 64, 512, 4, decode="fp8", nb=16, swap=True, fast_accum=True)
    fn = lambda x, w, s, xs: matmul(x, w, scale=s, x_scale=xs, block=blk, interpret=False)  # noqa: E731
    [ir] = triton_ir(fn, _sd((1, 8192), jnp.float8_e4m3fn), _sd((5120, 8192), jnp.float8_e4m3fn),
                     _sd((160, 256), jnp.uint8), _sd((1, 256), jnp.uint8))
    dots = [ln for ln in ir.splitlines() if "tt.dot" in ln]
    assert dots and all("maxNumImpreciseAcc = 512" in ln for ln in dots), dots[:1]
    mb = MoeBlock(2, 64, 256, decode="fp8", nb=8, swap=True, fast_accum=True)
    fn = lambda x, w, s, g, xs: grouped_matmul(x, w, g, scale=s, x_scale=xs, block=mb, interpret=False)  # noqa
    [ir] = triton_ir(fn, _sd((48, 5120), jnp.float8_e4m3fn), _sd((384, 2304, 2560), jnp.uint8),
                     _sd((384, 2304, 160), jnp.uint8), _sd((384,), jnp.int32), _sd((48, 160), jnp.uint8))
    wloads = [ln for ln in ir.splitlines() if "tt.addptr" in ln and "tensor<64x128x!tt.ptr<i8>>" in ln]
    assert wloads and all("xi64>" in ln for ln in wloads), wloads[:1]


def test_measured_tables_tile_their_shapes():
    """Every measured TUNED entry tiles its own (N, K) and resizes to every M it serves (1 .. its M)."""
    for (N, K, M), b in gemm_bs.TUNED.items():
        assert N % b.bn == 0 and K % (b.bk * b.splits) == 0, (N, K, M, b)
        for m in range(1, M + 1):
            r = gemm_bs.tuned_gemm_block(m, N, K, x_fp8=True)
            assert r is not None and r.bm * r.nb in (16, 32, 64) and K % (r.bk * r.splits) == 0, (N, K, m, r)
    for (kind, N, K, M), b in moe_bs.TUNED.items():
        assert kind in ("swiglu", "gmm") and N % b.bn == 0 and K % (b.bk * b.splits) == 0, (kind, N, K, M, b)
        r = moe_bs.pick_moe_block(M, N, K, fp4=True, active=min(M, 384), fused=kind == "swiglu", x_fp8=True)
        assert r.decode == b.decode and N % r.bn == 0 and K % (r.bk * r.splits) == 0, (kind, N, K, M, r)
