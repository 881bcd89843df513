"""Host time per decode step: how much of an engine step the Python side adds on top of the device program.

    python -m bench.host_overhead --preset tiny --batch 8 --out bench/results/host_overhead_tiny_cpu.json
    python -m bench.host_overhead --legacy .legacy ...    # the same measurement on an older checkout

B requests decode together (ignore_eos); after warm-up, each `Engine.step()` is timed (wall). Then the decode
program call the engine made is captured and replayed back-to-back N times with the same inputs: the time per
replayed call is the device time plus the bare dispatch. host overhead = median step wall - replay time per
call. The same code measures an older engine (`--legacy DIR`: a checkout of the repo at another commit, put
first on sys.path), so before/after numbers come from one script. Prints a short table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def measure(preset: str, batch: int, steps: int, replays: int, prompt_len: int, max_model_len: int, seed: int = 0):
    import jax
    import numpy as np

    import dsv41_jax  # noqa: F401
    from dsv41_jax.config import ModelConfig
    from serving.engine import Engine, EngineArgs, SamplingParams

    cfg = ModelConfig.preset(preset)
    if max_model_len > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=max_model_len)
    chunk = max(cfg.window_size, 64)
    args = EngineArgs(max_model_len=max_model_len, max_num_seqs=batch, max_num_batched_tokens=max(chunk, prompt_len),
                      prefill_buckets=(max(chunk, prompt_len),), decode_buckets=(batch,),
                      enable_prompt_logprobs=False)
    t0 = time.perf_counter()
    eng = Engine(cfg, args, progress=False)
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    n_tokens = steps * 2 + 16
    for i in range(batch):
        eng.add_request(f"h{i}", rng.integers(0, cfg.vocab_size, prompt_len).tolist(),
                        SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True))
    runner = eng.runner
    captured = []
    orig_run = runner.run

    def spy(key, *a):
        captured.append((key, a))
        return orig_run(key, *a)

    runner.run = spy
    for _ in range(8):  # prefill + a few decode steps (warm-up)
        eng.step()
    wall = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        wall.append(time.perf_counter() - t)
    key, a = captured[-1]
    runner.run = orig_run
    is_decode = (key[0] if isinstance(key, tuple) else key.kind) == "decode"
    if not is_decode:
        raise RuntimeError(f"the last program call was not a decode step: {key}")
    orig_run(key, *a)
    jax.block_until_ready(runner.pools)
    t = time.perf_counter()
    for _ in range(replays):
        res = orig_run(key, *a)
    jax.block_until_ready(runner.pools)
    if res is not None:
        jax.block_until_ready(getattr(res, "packed", res))
    replay = (time.perf_counter() - t) / replays
    step_med = statistics.median(wall)
    return {"preset": preset, "batch": batch, "backend": jax.default_backend(), "engine_build_s": round(build_s, 1),
            "step_wall_ms_median": round(1000 * step_med, 3), "step_wall_ms": [round(1000 * x, 3) for x in wall],
            "replay_ms_per_call": round(1000 * replay, 3),
            "host_overhead_ms": round(1000 * (step_med - replay), 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--replays", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--max-model-len", type=int, default=0, help="0: prompt + 4 x steps, rounded up")
    ap.add_argument("--legacy", default=None, help="measure the engine of this checkout instead of this one")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.legacy:
        sys.path.insert(0, a.legacy)
    mml = a.max_model_len or (-(-(a.prompt_len + 4 * a.steps + 64) // 64) * 64)
    res = measure(a.preset, a.batch, a.steps, a.replays, a.prompt_len, mml)
    res["engine"] = a.label or ("legacy:" + a.legacy if a.legacy else "current")
    print(f"{'engine':>16} {'preset':>7} {'B':>3} {'step ms':>9} {'device+dispatch ms':>19} {'host ms':>8}")
    print(f"{res['engine']:>16} {a.preset:>7} {a.batch:>3} {res['step_wall_ms_median']:>9} "
          f"{res['replay_ms_per_call']:>19} {res['host_overhead_ms']:>8}")
    if a.out:
        from bench.common import write_result

        write_result(a.out, res, command="python -m bench.host_overhead " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
