"""The seams between the engine, the runner and the model: typed step I/O, packed outputs, the kernel switch."""
import jax
import numpy as np
import pytest

from dsv41_jax.config import ModelConfig
from dsv41_jax.ops import PALLAS_OPS, ExecContext, TrainHooks, check_kernels_with_parallel, missing_pallas_ops
from serving.engine.config import EngineArgs
from serving.engine.step_io import (
    DECODE,
    PREFILL,
    ProgramKey,
    StepInputs,
    StepOutputs,
    mask_words,
    pack_outputs,
    unpack_outputs,
)
from serving.engine.types import MAX_LOGPROBS

TINY = ModelConfig.preset("tiny")


def test_kernels_pallas_fails_naming_the_missing_ops(monkeypatch):
    assert set(PALLAS_OPS) >= {"linear", "routed_experts", "sparse_attention", "indexer", "hc_boundary"}
    assert missing_pallas_ops() == []  # every op has its kernel today
    ExecContext(kernels="pallas")
    for name in ("hc_boundary", "indexer"):  # an op without a kernel is refused by name, never silently XLA
        monkeypatch.setitem(PALLAS_OPS, name, None)
    with pytest.raises(ValueError) as e:
        EngineArgs(max_model_len=256, kernels="pallas").resolved(TINY)
    assert "hc_boundary" in str(e.value) and "indexer" in str(e.value) and "linear" not in str(e.value)
    with pytest.raises(ValueError, match="no Pallas version"):
        ExecContext(kernels="pallas")
    with pytest.raises(ValueError, match="kernels must be one of"):
        EngineArgs(max_model_len=256, kernels="cuda").resolved(TINY)


def test_pallas_kernels_refuse_unsupported_model_configs(tiny_params):
    from serving.engine import Engine

    with pytest.raises(ValueError, match="window 8"):
        Engine(TINY, EngineArgs(max_model_len=256, kernels="pallas", max_num_batched_tokens=64,
                                prefill_buckets=(64,), decode_buckets=(1,), max_num_seqs=1), params=tiny_params,
               progress=False)


def test_exec_context_is_part_of_the_jit_key():
    a, b = ExecContext(), ExecContext()
    assert a == b and hash(a) == hash(b)  # equal contexts share compiled programs
    hooked = ExecContext(hooks=TrainHooks(indexer_stride=4))
    assert hooked != a and hooked == ExecContext(hooks=TrainHooks(indexer_stride=4))  # hooks are part of the key
    assert hooked != ExecContext(hooks=TrainHooks(indexer_stride=2))


def test_the_kernels_serve_tp_and_dep_layouts():
    """Every Pallas kernel runs under TP and DP / DEP (the TP results against one device: tests/test_parallel.py);
    the one rule's home still refuses unknown kernel names."""
    from dsv41_jax.sharding import Parallel

    for par in (Parallel.from_flags(2, 1, False, False), Parallel.from_flags(1, 2, True, False), None):
        check_kernels_with_parallel("xla", par)
        check_kernels_with_parallel("pallas", par)
    with pytest.raises(ValueError, match="kernels must be one of"):
        check_kernels_with_parallel("cuda", None)


@pytest.mark.parametrize("all_logits", [False, True])
def test_abstract_inputs_have_the_structure_of_host_inputs(all_logits):
    host = StepInputs.host(3, 16, 5, 1, 4, TINY.vocab_size, all_logits, 7)
    abst = StepInputs.abstract(3, 16, 5, 1, 4, TINY.vocab_size, all_logits)
    assert jax.tree.structure(host) == jax.tree.structure(abst)
    for h, a in zip(jax.tree.leaves(host), jax.tree.leaves(abst)):
        assert h.shape == a.shape and h.dtype == a.dtype
    assert (host.slots == 7).all()  # padding rows point at the scratch slot
    allowed = host.sampling.allowed
    assert allowed.shape == (3, mask_words(TINY.vocab_size)) and (allowed == 0xFFFFFFFF).all()
    assert (host.sampling.next_ids is not None) == all_logits


@pytest.mark.parametrize("all_logits", [False, True])
def test_outputs_pack_into_one_array_and_unpack_by_name(all_logits):
    rng = np.random.default_rng(0)
    B, T, n = 4, 8, MAX_LOGPROBS
    out = StepOutputs(rng.integers(0, 500, B).astype(np.int32), rng.normal(size=B).astype(np.float32),
                      rng.integers(0, 500, (B, n)).astype(np.int32), rng.normal(size=(B, n)).astype(np.float32))
    if all_logits:
        out.prompt_next_logprob = rng.normal(size=(B, T)).astype(np.float32)
        out.prompt_top_ids = rng.integers(0, 500, (B, T, n)).astype(np.int32)
        out.prompt_top_logprobs = rng.normal(size=(B, T, n)).astype(np.float32)
    fields = {k: v for k, v in vars(out).items() if v is not None}
    packed = jax.jit(lambda f: pack_outputs(StepOutputs(**f), T, all_logits))(fields)
    assert packed.ndim == 2 and packed.dtype == np.int32
    back = unpack_outputs(np.asarray(packed), T, all_logits)
    for name in vars(out):
        a, b = getattr(out, name), getattr(back, name)
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype


def test_program_keys_name_what_they_compute():
    k = ProgramKey(PREFILL, 64, "window")
    assert (k.batch, k.tokens, str(k)) == (1, 64, "prefill[64]:window+sample")
    d = ProgramKey(DECODE, 8)
    assert (d.batch, d.tokens) == (8, 1) and d < ProgramKey(PREFILL, 1)


def test_kernels_auto_picks_pallas_only_where_the_kernels_serve(monkeypatch):
    """`--kernels auto` (the default): XLA on a CPU; on a GPU the Pallas kernels (under TP and DEP too), unless the
    model config or eager execution has no Pallas path (then XLA, never an error)."""
    from serving.engine import config as engine_config

    assert EngineArgs().kernels == "auto"
    assert jax.default_backend() == "cpu"
    assert EngineArgs(max_model_len=256).resolved(TINY.replace(window_size=64)).kernels == "xla"
    w64 = TINY.replace(window_size=64)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert engine_config.auto_kernels(EngineArgs(max_model_len=256), w64) == "pallas"
    assert engine_config.auto_kernels(EngineArgs(max_model_len=256), TINY) == "xla"  # window 8
    assert engine_config.auto_kernels(EngineArgs(max_model_len=256, execution="eager"), w64) == "xla"
    assert engine_config.auto_kernels(EngineArgs(max_model_len=256, tensor_parallel_size=2), w64) == "pallas"
    assert engine_config.auto_kernels(EngineArgs(max_model_len=256, force_mesh=True), w64) == "pallas"  # TP of 1
    dep = EngineArgs(max_model_len=256, data_parallel_size=2, enable_expert_parallel=True)
    assert engine_config.auto_kernels(dep, w64) == "pallas"
    assert engine_config.auto_kernels(EngineArgs(max_model_len=256), w64.replace(compute_dtype="float32")) == "xla"
    monkeypatch.setitem(PALLAS_OPS, "indexer", None)
    assert engine_config.auto_kernels(EngineArgs(max_model_len=256), w64) == "xla"


def test_compilation_cache_keeps_eager_ops_only_for_eager_engines(monkeypatch):
    """Eager execution compiles thousands of small ops: they go to the persistent cache too (threshold 0 s);
    compiled execution caches only its programs (threshold 0.5 s). (The settings are recorded, not applied: the
    persistent cache is process-wide and the other tests share it.)"""
    import jax

    from serving.engine.engine import use_compilation_cache

    set_to: dict = {}
    monkeypatch.setattr(jax.config, "update", lambda name, value: set_to.__setitem__(name, value))
    use_compilation_cache("/some/dir", "eager")
    assert set_to == {"jax_compilation_cache_dir": "/some/dir", "jax_persistent_cache_min_compile_time_secs": 0.0}
    use_compilation_cache("/some/dir", "compiled")
    assert set_to["jax_persistent_cache_min_compile_time_secs"] == 0.5


def test_a_presets_random_weights_take_the_weight_format_asked_for():
    """`--model tiny --weight-format bf16` (and medium's fp8) builds the weights in that format, not the preset's
    default silently: the config says so and the linears' dtypes match it."""
    from serving.engine.engine import load_model

    for fmt, dtype in (("bf16", "bfloat16"), ("fp8", "float8_e4m3fn")):
        cfg, params = load_model("tiny", weight_format=fmt)
        assert cfg.weight_format == fmt
        dtypes = {str(x.dtype) for x in jax.tree.leaves(params)}
        assert (dtype in dtypes) and (fmt == "fp8" or "float8_e4m3fn" not in dtypes), (fmt, dtypes)
