"""What a CPU test pays to build a tiny engine: compile phases, a persistent-cache hit, memory mappings, XLA flags.

    python -m bench.cpu_engine_build [--out bench/results/cpu_engine_build.json]

Each variant runs in a fresh interpreter (XLA reads its flags once per process) with the tests' XLA flags
(tests/conftest.py: LLVM at -O0) and builds `Engine(tiny, SMALL_ENGINE_ARGS)` (the shared test server's shapes):
- the seconds of the build and of JAX's compile phases (jax.monitoring events: tracing, lowering, XLA's backend
  compile, persistent-cache retrieval);
- the process's memory mappings (/proc/self/maps lines) before the build, after it, and after the engine is
  dropped and JAX's caches cleared: what tests/conftest.py `_free_programs_after_each_file` relies on;
- greedy tokens and logprobs of one request, so a flag that changed the numerics would show.
Variants: a cold persistent cache, the same cache warm (a hit), and one extra XLA:CPU flag each (cache off).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

BASE_FLAGS = "--xla_backend_optimization_level=0"  # tests/conftest.py
EXTRA_FLAGS = ("--xla_cpu_use_xnnpack=false", "--xla_llvm_disable_expensive_passes=true",
               "--xla_cpu_enable_concurrency_optimized_scheduler=false",
               "--xla_cpu_copy_insertion_use_region_analysis=false")
PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
          "/jax/core/compile/backend_compile_duration": "backend_compile_s",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_read_s"}


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def child(cache: str | None) -> dict:
    """One build in this process (XLA_FLAGS already set by the parent)."""
    import gc
    import time
    from collections import Counter

    import jax
    import numpy as np

    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.params import init_params
    from serving.engine import Engine, EngineArgs, SamplingParams
    from serving.engine.config import SMALL_ENGINE_ARGS

    cfg = ModelConfig.preset("tiny")
    params = jax.jit(lambda: init_params(cfg, 0))()
    phases: Counter = Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, d, **_: phases.update({PHASES[name]: d}) if name in PHASES else None)
    m0 = _mappings()
    t0 = time.perf_counter()
    eng = Engine(cfg, EngineArgs(**SMALL_ENGINE_ARGS), params=params, progress=False)
    build = time.perf_counter() - t0
    m1 = _mappings()
    eng.add_request("a", np.random.default_rng(0).integers(0, cfg.vocab_size, 150).tolist(),
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0))
    outs = list(eng.run_until_done())
    ids = [t for o in outs for t in o.new_token_ids]
    lps = [round(float(d[t]), 5) for o in outs for d, t in zip(o.new_logprobs or [], o.new_token_ids)]
    programs = len(eng.runner.programs)
    del eng, outs
    gc.collect()
    jax.clear_caches()
    gc.collect()
    return {"build_s": round(build, 2), **{k: round(phases[k], 2) for k in PHASES.values()},
            "programs": programs, "maps_before": m0, "maps_built": m1, "maps_freed": _mappings(),
            "tokens": ids, "logprobs": lps}


def run_variant(flags: str, cache: str | None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    cmd = [sys.executable, "-m", "bench.cpu_engine_build", "--child"] + (["--cache", cache] if cache else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--cache", default=None)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.cache)))
        return
    from tqdm import tqdm

    from bench.common import write_result

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        plan = [("cache cold", BASE_FLAGS, cache), ("cache warm (hit)", BASE_FLAGS, cache)]
        plan += [(f, f"{BASE_FLAGS} {f}", None) for f in EXTRA_FLAGS]
        for name, flags, c in tqdm(plan, desc="engine builds"):
            rows.append({"variant": name, "xla_flags": flags, **run_variant(flags, c)})
    ref = rows[0]
    print(f"{'variant':<58} {'build s':>7} {'backend':>7} {'trace':>5} {'lower':>5} {'maps +':>6} {'freed':>6} same")
    for r in rows:
        same = r["tokens"] == ref["tokens"] and r["logprobs"] == ref["logprobs"]
        print(f"{r['variant']:<58} {r['build_s']:>7} {r['backend_compile_s']:>7} {r['trace_s']:>5} {r['lower_s']:>5}"
              f" {r['maps_built'] - r['maps_before']:>6} {r['maps_freed']:>6} {same}")
    if a.out:
        write_result(a.out, {"engine_args": "SMALL_ENGINE_ARGS", "preset": "tiny", "rows": rows},
                     command="python -m bench.cpu_engine_build")


if __name__ == "__main__":
    main()
