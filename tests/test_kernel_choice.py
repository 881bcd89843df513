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
