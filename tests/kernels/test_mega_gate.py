"""The Mega-Gate kernel (pallas_kernels/mega_gate, interpret mode, GPU-legal blocks) against its one jnp reference,
dsv41_jax.layers.gate (the ops seam's XLA branch): several row / expert / chunk splits, a stacked weight read in
place, ties broken lower-id-first, the ops seam's Pallas MoE branch against the XLA one on the tiny model, and
the GPU lowering at the full shape.

Outputs are fresh buffers that interpret mode fills with NaN, so an unwritten element fails the finiteness check.
Contract (the kernel's docstring): expert ids equal except at near-ties of the k-th biased score, weights within
1e-5 relative."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import layers, ops, quant
from dsv41_jax.config import ModelConfig
from dsv41_jax.weights import LayerRef
from pallas_kernels.common import lower_for_h200
from pallas_kernels.mega_gate import GateBlocks, route


def _case(seed, n, e, d, layers_=3):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, d ** -0.5, (layers_, e, d)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(0, 0.1, (layers_, e)), jnp.float32)
    return x, w, b


def _check(cfg, got, want, x, w, b):
    gw, gi = (np.asarray(a) for a in got)
    ww, wi = (np.asarray(a) for a in want)
    assert gw.shape == ww.shape and gi.shape == wi.shape and np.isfinite(gw).all()
    # near-ties of the biased score may legitimately swap: allow a differing row only there
    s = np.sqrt(np.logaddexp(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T, 0)) + np.asarray(b)
    srt = -np.sort(-s, axis=1)
    k = cfg.n_activated_experts
    tie = np.abs(srt[:, k - 1] - srt[:, k]) < 1e-5 if srt.shape[1] > k else np.zeros(len(s), bool)
    same = (gi == wi).all(axis=1)
    assert (same | tie).all()
    np.testing.assert_allclose(gw[same], ww[same], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n,e,k,d,blocks", [
    (1, 16, 2, 256, GateBlocks(16, 16, 64)),  # one program per chunk, 4 chunks
    (5, 100, 6, 256, GateBlocks(16, 32, 128)),  # 4 expert blocks (the last partial) x 2 chunks
    (40, 48, 6, 128, GateBlocks(32, 64, 128)),  # 2 row blocks, one expert block, one chunk
])
def test_kernel_matches_reference(n, e, k, d, blocks):
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=e, n_activated_experts=k)
    x, w, b = _case(n + e, n, e, d)
    want = layers.gate(cfg, {"weight": w[1], "bias": b[1]}, x)
    got = route(x, w, b, k=k, route_scale=cfg.route_scale, norm_topk_prob=cfg.norm_topk_prob, layer=jnp.int32(1),
                blocks=blocks)
    _check(cfg, got, want, x, w[1], b[1])


def test_ties_pick_the_lower_expert_and_no_normalisation():
    cfg = ModelConfig.preset("tiny").replace(n_routed_experts=16, n_activated_experts=3, norm_topk_prob=False)
    x, w, b = _case(9, 3, 16, 64, 1)
    w = w.at[0, 9].set(w[0, 4]).at[0, 12].set(w[0, 4])  # experts 4, 9, 12 score the same
    b = b.at[0, jnp.array([4, 9, 12])].set(5.0)  # ... and win
    want = layers.gate(cfg, {"weight": w[0], "bias": b[0]}, x)
    got = route(x, w[0], b[0], k=3, route_scale=cfg.route_scale, norm_topk_prob=False)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.tile([4, 9, 12], (3, 1)))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)


def test_ops_pallas_moe_matches_xla(tiny, tiny_params):
    """ops.moe with kernels="pallas" (Mega-Gate + the GEMM kernels, xq fed as Mega-mHC would) against XLA:
    measured bit-identical in interpret mode; asserted to a bf16 ulp of the output's scale."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(0, 1, (2, 3, tiny.dim)), jnp.bfloat16)
    p = LayerRef(tiny_params["layers"], jnp.int32(1))["ffn"]
    want, _ = ops.moe(ops.ExecContext(), tiny, p, x)
    want = np.asarray(want, np.float32)
    for xq in (None, quant.fp8_qdq(x, 32)):
        got, _ = ops.moe(ops.ExecContext(kernels="pallas"), tiny, p, x, xq=xq)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=np.abs(want).max() * 2.0 ** -8)


@pytest.mark.parametrize("n,e", [(1, 384), (256, 16)])
def test_lowers_for_the_h200_at_the_full_shape(n, e):
    sds = jax.ShapeDtypeStruct
    text = lower_for_h200(
        lambda x, w, b, l: route(x, w, b, k=6, route_scale=1.5, norm_topk_prob=True, layer=l, interpret=False),
        sds((n, 5120), jnp.bfloat16), sds((40, e, 5120), jnp.bfloat16), sds((40, e), jnp.float32),
        sds((), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") == 1
