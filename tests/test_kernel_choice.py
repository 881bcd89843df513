"""`--kernels auto` keeps the fused kernels that measured slower than XLA on XLA (dsv41_jax.ops.AUTO_XLA_OPS), and
ExecContext.xla_ops routes exactly those ops to their XLA versions beside the other Pallas kernels."""

import jax
import pytest

from dsv41_jax import layers, ops
from dsv41_jax.config import ModelConfig
from serving.engine import config as engine_config
from serving.engine.config import EngineArgs

TINY = ModelConfig.preset("tiny")


def test_auto_keeps_the_slower_fused_kernels_on_xla(monkeypatch):
    w64 = TINY.replace(window_size=64)
    on_cpu = EngineArgs(max_model_len=256).resolved(w64)
    assert (on_cpu.kernels, on_cpu.xla_ops) == ("xla", ())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    auto = EngineArgs(max_model_len=256).resolved(w64)
    assert auto.kernels == "pallas" and set(auto.xla_ops) == set(ops.AUTO_XLA_OPS)
    explicit = EngineArgs(max_model_len=256, kernels="pallas").resolved(w64)
    assert (explicit.kernels, explicit.xla_ops) == ("pallas", ())  # --kernels pallas: every kernel
    assert engine_config.auto_kernels(EngineArgs(max_model_len=256), TINY) == "xla"


def test_xla_ops_route_only_the_named_ops(monkeypatch):
    with pytest.raises(ValueError, match="xla_ops"):
        ops.ExecContext(kernels="pallas", xla_ops=("sparse_attention",))  # no XLA version beside the pool layout
    monkeypatch.setitem(ops.PALLAS_OPS, "gate", lambda *a, **k: None)  # a kernel distinct from layers.gate
    mixed = ops.ExecContext(kernels="pallas", xla_ops=("gate",))
    assert ops._impl(mixed, "gate") is None
    assert ops._impl(mixed, "linear") is ops.PALLAS_OPS["linear"]
    assert ops._impl(ops.ExecContext(kernels="pallas"), "gate") is ops.PALLAS_OPS["gate"]
    assert ops._impl(ops.ExecContext(kernels="xla", xla_ops=("gate",)), "gate") is None

    assert ops._gate(mixed) is layers.gate  # the router the MoE calls
    assert ops._gate(ops.ExecContext(kernels="pallas")) is ops.PALLAS_OPS["gate"]


def test_auto_boundary_runs_the_sinkhorn_kernel_inside_xla(monkeypatch):
    """Under auto, XLA's mHC boundary calls the Sinkhorn kernel (pallas_kernels/mhc) in place of its while loop:
    the kernel is the one called, and the boundary's outputs match the all-XLA boundary on random inputs."""
    import jax.numpy as jnp

    cfg = TINY
    hc, D, N = cfg.hc_mult, cfg.dim, 5
    ks = jax.random.split(jax.random.key(3), 6)
    res = ops.Residual(h=jax.random.normal(ks[0], (1, N, hc, D), jnp.bfloat16),
                   y=jax.random.normal(ks[1], (1, N, D), jnp.bfloat16),
                   mix=jax.random.normal(ks[2], (1, N, (2 + hc) * hc), jnp.float32))
    w = {"hc_attn_fn": 0.05 * jax.random.normal(ks[3], ((2 + hc) * hc, hc * D), jnp.float32),
         "hc_attn_scale": jnp.array([0.7, 1.1, 0.9], jnp.float32),
         "hc_attn_base": 0.3 * jax.random.normal(ks[4], ((2 + hc) * hc,), jnp.float32),
         "attn_norm": 1 + 0.1 * jax.random.normal(ks[5], (D,), jnp.float32)}
    calls = []
    kernel = ops.PALLAS_OPS["hc_coefficients"]

    def counted(*a):
        calls.append(1)
        return kernel(*a)

    ref = ops.hc_boundary(ops.ExecContext(kernels="xla"), cfg, res, w, "attn")
    assert not calls
    auto = ops.ExecContext(kernels="pallas", xla_ops=ops.AUTO_XLA_OPS)
    monkeypatch.setitem(ops.PALLAS_OPS, "hc_coefficients", counted)
    got = ops.hc_boundary(auto, cfg, res, w, "attn")
    assert calls == [1]
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
            continue
        g, r = jnp.asarray(g, jnp.float32), jnp.asarray(r, jnp.float32)
        assert float(jnp.max(jnp.abs(g - r) / jnp.maximum(1.0, jnp.abs(r)))) <= 2e-5
    # the mixes differ from the input mixes (the Sinkhorn ran), and the comb block is doubly stochastic
    mix = got[3].reshape(N, -1)[:, 2 * hc:].reshape(N, hc, hc)
    assert float(jnp.max(jnp.abs(jnp.sum(mix, axis=-2) - 1))) < 1e-3


def test_benchmark_kernel_variants_switch_one_op_each():
    """bench.common's `--kernels` variants: each "auto+<kernel>" runs exactly one op of auto's XLA list as its
    kernel, and every variant names ops ExecContext accepts."""
    from bench.common import KERNEL_VARIANTS, kernel_args

    for name, (add, drop) in KERNEL_VARIANTS.items():
        kw = kernel_args(name)
        assert kw["kernels"] == "pallas"
        ops.ExecContext(**kw)  # valid op names
        assert set(kw["xla_ops"]) == (set(ops.AUTO_XLA_OPS) - set(drop)) | set(add)
    for name, op in (("auto+mega-mhc", "hc_boundary"), ("auto+mega-gate", "gate"), ("auto+ring-write", "ring_write"),
                     ("auto+act-quant", "act_quant")):
        assert set(ops.AUTO_XLA_OPS) - set(kernel_args(name)["xla_ops"]) == {op}
    assert kernel_args("auto") == {"kernels": "auto"}


def test_act_quant_kernel_feeds_the_gemms_the_xla_values():
    """The GEMMs' FP8 inputs from the one-launch kernel (the Pallas default) or from XLA ("act_quant" in xla_ops)
    give bit-identical linears and routed experts on random inputs (tiny preset: FP8 linears, MXFP4 experts), at
    decode sizes (the kernel) and above ACT_QUANT_KERNEL_MAX_ROWS (XLA on both sides); the kernel is the one called."""
    import jax.numpy as jnp
    import numpy as np

    import checkpoints
    from dsv41_jax.weights import LayerRef

    cfg = TINY.replace(weight_format="fp8")
    stack = checkpoints.random_init(cfg, 0)["layers"]
    wq_a, experts = LayerRef(stack["attn"]["wq_a"], jnp.int32(1)), LayerRef(stack["ffn"]["experts"], jnp.int32(2))
    assert stack["attn"]["wq_a"]["weight"].dtype == jnp.float8_e4m3fn
    kernel_ctx, xla_ctx = ops.ExecContext(kernels="pallas"), ops.ExecContext(kernels="pallas", xla_ops=("act_quant",))
    calls = []
    kernel = ops.act_quant_kernel.quantize

    def counted(x, **kw):
        calls.append(x.shape)
        return kernel(x, **kw)

    for rows in (3, ops.ACT_QUANT_KERNEL_MAX_ROWS + 8):
        x = jax.random.normal(jax.random.key(rows), (1, rows, cfg.dim), jnp.bfloat16) * 3
        idx = jax.random.randint(jax.random.key(1), (rows, cfg.n_activated_experts), 0, cfg.n_routed_experts)
        w = jax.random.uniform(jax.random.key(2), idx.shape, jnp.float32, 0.1, 1.0)
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops.act_quant_kernel, "quantize", counted)
            got = ops.linear(kernel_ctx, cfg, wq_a, x)
            got_e = ops.routed_experts(kernel_ctx, cfg, experts, x[0], w, idx)
        # the linear's x, the experts' x and their hidden rows: all through the kernel at decode sizes
        assert len(calls) == (3 if rows <= ops.ACT_QUANT_KERNEL_MAX_ROWS else 0), calls
        want = ops.linear(xla_ctx, cfg, wq_a, x)
        want_e = ops.routed_experts(xla_ctx, cfg, experts, x[0], w, idx)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        np.testing.assert_array_equal(np.asarray(got_e, np.float32), np.asarray(want_e, np.float32))
        assert float(jnp.max(jnp.abs(got.astype(jnp.float32)))) > 0 and float(jnp.max(jnp.abs(got_e))) > 0
