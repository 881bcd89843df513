import gc
import os
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The xdist workers (and their server subprocesses) share one persistent compilation cache. With no size limit JAX
# reads and writes its entries without a lock (a reader could see a half-written entry: a decompression error and a
# recompile); a size limit turns on JAX's file lock around every read and write. 64 GiB is never reached. (The CI
# segfaults once blamed on this were the memory-mapping limit: see _free_programs_after_each_file below.)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(64 * 2 ** 30))
# CPU tests: LLVM at -O0 compiles the many small programs ~40% faster (results are still bit-for-bit
# comparable between paths, which all run under the same flags). $DSV41_TEST_XLA_LEVEL overrides it for
# experiments: level 1 compiled the engine fixtures 1.3-3x slower and moved an engine-vs-model logprob check
# past its tolerance (docs/BENCHMARKS.md "CI time").
XLA_LEVEL = os.environ.get("DSV41_TEST_XLA_LEVEL", "0")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_backend_optimization_level={XLA_LEVEL}").strip()

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
# many short files fill the other worker meanwhile. Every test still runs; only the order changes. test_engine.py
# goes first: it compiles the shared engine shapes (SMALL_ENGINE_ARGS; EXACT_ENGINE_ARGS in tests/harness.py) that later
# files (the API servers, tests/test_host_tier.py) then read from the persistent compilation cache.
SLOW_FIRST = (  # a full run at 14d1b67, seconds per file (setup + call), cores otherwise idle
    "test_engine.py",  # 204
    "test_training_attention_default.py",  # 200
    "test_spec_decode.py",  # 189
    "test_paths.py",  # 156
    "test_engine_pallas.py",  # 153
    "test_parallel.py",  # 138
    "test_api_structured_budget.py",  # 108
    "test_default_model.py",  # 90
    "test_engram_host.py",  # 87
    "test_training_attention.py",  # 85
    "test_default_model_generation.py",  # 78
)


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the restart limit when it makes its session
def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # A crashed worker fails the run at once, naming its test. Replacing it instead hung `--dist loadfile` until
    # CI's time limit (pytest-xdist's known hang; seen on 676a485).
    if hasattr(config.option, "maxworkerrestart") and config.option.maxworkerrestart is None:
        config.option.maxworkerrestart = "0"


# ------------------------------------------------------------------ one worker runs many files: free their programs
# An XLA:CPU executable of a whole tiny model maps ~900-1,250 memory regions (its JIT-linked kernels); a tiny
# engine's four programs 3,700-5,100 (python -m bench.cpu_engine_build). A worker that kept every file's programs
# alive (engines held by jit caches of library functions, paths compiled per config) reached Linux's limit of
# 65,530 mappings; the next JIT link then failed and the C++ exception it raised crashed in the unwinder (a
# registered frame of the half-linked code was already unmapped): segfaults in compile, serialize or deserialize
# at varying places (CI of 9712819 and 676a485; a core of one held 65,432 mappings). After each file its programs
# are freed; the shared servers' stay.
MAP_WARN = 45_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _log_mappings(request):
    """$DSV41_TEST_MAPS_LOG: append each test's mapping count to that file (to find what keeps programs alive)."""
    yield
    path = os.environ.get("DSV41_TEST_MAPS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {_mappings()} {request.node.nodeid}\n")


@pytest.fixture(autouse=True, scope="module")
def _free_programs_after_each_file(request):
    yield
    gc.collect()
    jax.clear_caches()
    gc.collect()
    n = _mappings()
    if n > MAP_WARN:
        warnings.warn(f"{n} memory mappings after {request.node.name} (the limit is ~65,530): programs kept alive",
                      stacklevel=1)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: the others keep their order
