"""Engine benchmark: warm-up (programs compiled, seconds), cold vs warm-turn TTFT (SWA bounded replay), and
decode inter-token latency, measured side by side in one process.

    python -m bench.engine_bench --preset medium --prompt-len 8192 --out bench/results/engine_medium_h200.json

A "warm turn" resends the first prompt plus its output plus `--new-tokens` fresh tokens: the prefix cache
hits the full pages, the engine replays the last window (128) and prefills only the new tail, and the decoder
runs on the last 128 rows. Prints a short table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import dsv41_jax  # noqa: F401
from bench.common import write_result
from dsv41_jax.config import ModelConfig
from dsv41_jax.ops import KERNEL_CHOICES
from serving.engine import Engine, EngineArgs, SamplingParams
from serving.engine.engine import load_model


def ttft(engine, rid, prompt, sp, salt):
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, sp, cache_salt=salt)
    first, ids = None, []
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and first is None:
                first = time.perf_counter() - t0
            ids += o.new_token_ids
    return first, ids, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium", help="a preset (random weights) or a checkpoint directory")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kernels", default="xla", choices=KERNEL_CHOICES, help="the engine's kernel choice")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's async scheduling (serving/engine/device_tokens.py)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if os.path.isdir(a.preset):  # a checkpoint (e.g. the embedded default model)
        cfg, params = load_model(a.preset)
    else:
        cfg, params = ModelConfig.preset(a.preset), None
    args = EngineArgs(max_model_len=a.max_model_len, max_num_seqs=a.decode_batch, max_num_batched_tokens=a.chunk,
                      prefill_buckets=(cfg.window_size * 4, a.chunk), decode_buckets=(1, a.decode_batch),
                      enable_prompt_logprobs=False, kernels=a.kernels, async_scheduling=a.async_scheduling)
    t0 = time.perf_counter()
    eng = Engine(cfg, args, params=params)
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cold, warm = [], []
    for r in range(a.reps):
        p1 = rng.integers(0, cfg.vocab_size, a.prompt_len).tolist()
        c, out1, _ = ttft(eng, f"c{r}", p1, greedy, f"s{r}")
        p2 = p1 + out1 + rng.integers(0, cfg.vocab_size, a.new_tokens).tolist()
        w, _, _ = ttft(eng, f"w{r}", p2, greedy, f"s{r}")
        cold.append(c)
        warm.append(w)
    # decode: a batch of requests with short prompts, many tokens each
    sp = SamplingParams(max_tokens=a.decode_tokens, temperature=0.0, ignore_eos=True)
    stamps: dict[str, list[float]] = {}
    for i in range(a.decode_batch):
        rid = f"d{i}"
        stamps[rid] = []
        eng.add_request(rid, rng.integers(0, cfg.vocab_size, min(256, a.max_model_len // 4)).tolist(), sp,
                        cache_salt=rid,
                        callback=lambda o, rid=rid: stamps[rid].append(time.perf_counter()))
    eng.run_until_done()
    itl = [b - a_ for s in stamps.values() for a_, b in zip(s[1:], s[2:])]
    res = {
        "preset": a.preset, "kernels": a.kernels, "async_scheduling": a.async_scheduling, "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "chunk": a.chunk,
        "warmup_s": round(eng.warmup_s, 2), "programs": eng.runner.compile_count, "engine_build_s": round(build_s, 2),
        "cold_ttft_s": [round(x, 4) for x in cold], "warm_ttft_s": [round(x, 4) for x in warm],
        "cold_ttft_median_s": round(statistics.median(cold), 4),
        "warm_ttft_median_s": round(statistics.median(warm), 4),
        "warm_over_cold": round(statistics.median(warm) / statistics.median(cold), 4),
        "decode_batch": a.decode_batch, "itl_median_s": round(statistics.median(itl), 5) if itl else None,
        "pool_bytes": eng.runner.pool_bytes(), "metrics": eng.metrics.snapshot()["counters"],
    }
    print(f"{'preset':>8} {'programs':>8} {'warmup s':>9} {'cold TTFT s':>12} {'warm TTFT s':>12} {'warm/cold':>9} "
          f"{'ITL ms (B=' + str(a.decode_batch) + ')':>14}")
    print(f"{a.preset:>8} {res['programs']:>8} {res['warmup_s']:>9} {res['cold_ttft_median_s']:>12} "
          f"{res['warm_ttft_median_s']:>12} {res['warm_over_cold']:>9} {1000 * (res['itl_median_s'] or 0):>14.2f}")
    if a.out:
        write_result(a.out, res, command="python -m bench.engine_bench " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out" and v is not None))


if __name__ == "__main__":
    main()
