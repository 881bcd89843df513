"""Compile time of the full-sequence forward for a preset, lowered for an abstract input (no weights).

    python -m bench.compile_time --preset medium --tokens 4096 [--out bench/results/compile_medium_cpu.json]

Lowers and compiles `dsv41_jax.model.step` (encoder + decoder on all rows, logits for the last row) with
jax.ShapeDtypeStruct parameters and state, so nothing is allocated; prints and records the times.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import dsv41_jax  # noqa: F401  (sets XLA flags before the backend starts)
from bench.common import write_result
from dsv41_jax.config import ModelConfig
from dsv41_jax.model import ChunkInputs, init_state, step
from dsv41_jax.params import abstract_params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = ModelConfig.preset(a.preset)
    B, T = a.batch, a.tokens
    params = abstract_params(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, B, T))
    i32 = jax.ShapeDtypeStruct((B,), jnp.int32)
    toks = jax.ShapeDtypeStruct((B, T), jnp.int32)
    n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    ids = jax.ShapeDtypeStruct((B, T, len(cfg.engram_layer_ids), n_cols), jnp.int32) if cfg.engram_layer_ids else None
    t0 = time.perf_counter()
    inp = ChunkInputs(toks, ids, i32, i32, i32, i32, i32)
    lowered = step.lower(cfg, params, state, inp, fresh=True, n_dec=T, n_logits=1)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    res = {"preset": a.preset, "tokens": T, "batch": B, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
           "total_s": round(t2 - t0, 2), "hlo_chars": len(lowered.as_text()), "backend": jax.default_backend()}
    print(f"{'preset':>8} {'tokens':>6} {'lower s':>8} {'compile s':>9} {'total s':>8}")
    print(f"{a.preset:>8} {T:>6} {res['lower_s']:>8} {res['compile_s']:>9} {res['total_s']:>8}")
    if a.out:
        write_result(a.out, res, command=f"python -m bench.compile_time --preset {a.preset} --tokens {T}")


if __name__ == "__main__":
    main()
