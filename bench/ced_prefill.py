"""CED prefill vs the plain causal-LM prefill, side by side in one run (the model paths, no engine).

    python -m bench.ced_prefill --preset medium --tokens 8192 --out bench/results/ced_prefill_medium_h200.json

Both run the encoder band (layers 0-19 and layer 20's global-KV build) on every token; "ced" runs the decoder
band (the rest of layer 20 and layers 21-39) on the last window (128 rows), "full" on every row. Median of
`--reps` timed runs after one warm-up (compile) run each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsv41_jax  # noqa: F401
from bench.common import write_result
from dsv41_jax.config import ModelConfig
from dsv41_jax.engram_hash import EngramHasher
from dsv41_jax.model import ChunkInputs, init_state, step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cfg = ModelConfig.preset(a.preset)
    import checkpoints

    params = checkpoints.random_init(cfg, 0)
    T = a.tokens
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, T)).astype(np.int32)
    ids = jnp.asarray(EngramHasher(cfg).hash_ids(toks)) if cfg.engram_layer_ids else None
    res = {"preset": a.preset, "tokens": T}
    for mode, n_dec in (("ced", cfg.window_size), ("full", T)):
        def run():
            state = init_state(cfg, 1, T)
            inp = ChunkInputs.make(toks, ids, dec_clip=T - n_dec)
            lg = step(cfg, params, state, inp, fresh=True, n_dec=n_dec, n_logits=1).logits
            return jax.block_until_ready(lg)

        t0 = time.perf_counter()
        run()
        res[f"{mode}_first_call_s"] = round(time.perf_counter() - t0, 2)
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        res[f"{mode}_s"] = [round(x, 4) for x in times]
        res[f"{mode}_median_s"] = round(statistics.median(times), 4)
    res["ced_over_full"] = round(res["ced_median_s"] / res["full_median_s"], 4)
    print(f"{'preset':>8} {'tokens':>7} {'CED s':>8} {'full s':>8} {'CED/full':>9}")
    print(f"{a.preset:>8} {T:>7} {res['ced_median_s']:>8} {res['full_median_s']:>8} {res['ced_over_full']:>9}")
    if a.out:
        write_result(a.out, res, command=f"python -m bench.ced_prefill --preset {a.preset} --tokens {T}")


if __name__ == "__main__":
    main()
