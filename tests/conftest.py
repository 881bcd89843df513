import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The xdist workers (and their server subprocesses) share one persistent compilation cache. With no size limit JAX
# reads and writes its entries without a lock, and a worker that read an entry the other was still writing crashed
# XLA (a segfault deserialising a partial executable in tests/test_replay_quality.py, CI run of 9712819). A size
# limit turns on JAX's file lock around every cache read and write; 64 GiB is never reached.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(64 * 2 ** 30))
# CPU tests: LLVM at -O0 compiles the many small programs ~40% faster (results are still bit-for-bit
# comparable between paths, which all run under the same flags).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dsv41_jax  # noqa: E402,F401  (sets XLA flags before JAX starts its backend)
from serving.engine.config import shared_cache_dir  # noqa: E402

# One persistent compilation cache for the whole test process (JAX keeps one per process): engines built with
# the same shapes in different tests, a "restarted" engine, and the servers' subprocesses reuse programs.
os.makedirs(shared_cache_dir(), exist_ok=True)
jax.config.update("jax_compilation_cache_dir", shared_cache_dir())
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # programs, not eager ops
from dsv41_jax.config import ModelConfig  # noqa: E402
from dsv41_jax.params import init_params  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="session")
def tiny():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="session")
def tiny_params(tiny):
    return jax.jit(lambda: init_params(tiny, 0))()


@pytest.fixture(scope="session")
def tiny32():
    """f32 compute with every quantize-dequantize point off: paths must agree to f32 rounding."""
    return ModelConfig.preset("tiny", qdq=False, compute_dtype="float32")


@pytest.fixture(scope="session")
def tiny32_params(tiny32):
    return jax.jit(lambda: init_params(tiny32, 0))()


@pytest.fixture(scope="session")
def tokens():
    return np.random.default_rng(1234).integers(0, 512, (2, 40)).astype(np.int32)


# ------------------------------------------------------------------ CI scheduling (pytest -n 2 --dist loadfile)
# The slowest files, slowest first (per-file CPU time of a full run, docs/BENCHMARKS.md "CI time"). xdist hands out
# whole files in collection order (its default reorder, by number of tests per file, is turned off below, since it
# put these one-test files last, where they ran alone at the end of the run); starting with the long ones lets the
# many short files fill the other worker meanwhile. Every test still runs; only the order changes.
SLOW_FIRST = (  # a full run at 559b2ed, seconds per file (setup + call), other jobs sharing the cores
    "test_engine_pallas.py",  # 971
    "test_spec_decode.py",  # 935
    "test_training_attention_default.py",  # 635
    "test_parallel.py",  # 558
    "test_paths.py",  # 497
    "test_engine.py",  # 470
    "test_training_attention.py",  # 1384 then, ~40% of it since (two whole-model steps of five)
    "test_engram_host.py",  # 354
    "test_default_model_generation.py",  # 333
    "test_api_http.py",  # 318
    "test_train_dspark.py",  # 293
    "test_api_structured_budget.py",  # 265
    "test_default_model.py",  # 262
    "test_checkpoints.py",  # 246
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: the others keep their order
