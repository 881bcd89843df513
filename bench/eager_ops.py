"""What an eager engine step costs: primitive dispatches per prefill chunk and per decode step.

    python -m bench.eager_ops --models tiny,medium-narrow --out bench/results/eager_ops_cpu.json

The day-0 baseline (`bench.agentx.run.DAY0`) runs the engine's step function under `jax.disable_jit()`: every
JAX primitive is dispatched from Python one at a time, the 40-layer `lax.scan` and the mHC Sinkhorn
`fori_loop` become Python loops, and each distinct (primitive, operand shapes) pair is compiled the first time
it is seen. This benchmark counts those dispatches by hooking the eager interpreter
(`jax._src.core.EvalTrace.process_primitive`, internal: it only counts, every call goes through unchanged)
while one request runs through a day-0 engine: its prefill chunk(s), then its decode steps. It reports, per
step, the dispatches, the distinct (primitive, shapes) pairs not seen before (first-use compilations) and the
wall time, and per model the steady-state time per dispatch on this machine. With `--compilation-cache DIR`
the ops go to JAX's persistent cache as an eager server's do: a second run shows what a restart saves.

`medium-narrow` is `medium` (V4.1-Flash's 40-layer schedule: 2 SWA layers, 18 ratio-2 and 20 ratio-1 layers,
4 KV sources, 8 index sources, Engram at layers 1 and 14, 16 routed experts) with small widths, so that it
runs on a CPU: the number of dispatches depends on the layer schedule and the loop trip counts, not on the
widths. On an accelerator, the dispatch count x the per-dispatch host cost bounds an eager step from below.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time

import numpy as np

NARROW = dict(dim=128, n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=8, o_lora_rank=64,
              index_n_heads=4, index_head_dim=32, index_topk=64, candidate_topk_blocks=16, candidate_block_size=8,
              moe_inter_dim=64, vocab_size=1024, engram_n_heads=2, engram_head_dim=32,
              engram_compressed_vocab_size=1024)


def model_config(name: str, max_len: int):
    from dsv41_jax.config import ModelConfig

    if name.endswith("-narrow"):
        return ModelConfig.preset(name[: -len("-narrow")], max_seq_len=max_len, **NARROW).replace(
            name=name)
    return ModelConfig.preset(name, max_seq_len=max(max_len, ModelConfig.preset(name).max_seq_len))


@contextlib.contextmanager
def count_dispatches():
    """Yields (counts, seen): counts[primitive name] += 1 per eager dispatch; `seen` collects the distinct
    (primitive, operand shapes and dtypes) pairs."""
    from jax._src import core

    counts: collections.Counter = collections.Counter()
    seen: set = set()
    orig = core.EvalTrace.process_primitive

    def hooked(self, primitive, tracers, params):
        counts[primitive.name] += 1
        seen.add((primitive.name, tuple((getattr(t, "shape", None), str(getattr(t, "dtype", ""))) for t in tracers)))
        return orig(self, primitive, tracers, params)

    core.EvalTrace.process_primitive = hooked
    try:
        yield counts, seen
    finally:
        core.EvalTrace.process_primitive = orig


def measure(name: str, prompt_len: int, decode_tokens: int, chunk: int, seed: int = 0) -> dict:
    """One request (prompt_len tokens, decode_tokens outputs) through a day-0 engine, step by step."""
    from bench.agentx.run import DAY0
    from serving.engine import Engine, EngineArgs, SamplingParams

    max_len = max(256, 2 ** int(np.ceil(np.log2(prompt_len + decode_tokens + 1))))
    cfg = model_config(name, max_len)
    args = EngineArgs(max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=chunk, prefill_buckets=(chunk,),
                      decode_buckets=(1,), **DAY0)
    engine = Engine(cfg, args, progress=False)
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, prompt_len).tolist()
    steps = []
    with count_dispatches() as (counts, seen):
        engine.add_request("r", prompt, SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0.0))
        while engine.has_unfinished():
            counts.clear()
            n_seen = len(seen)
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            n = sum(counts.values())
            if n:
                steps.append({"dispatches": n, "new_distinct": len(seen) - n_seen, "s": round(dt, 4),
                              "tokens_out": sum(len(o.new_token_ids) for o in outs),
                              "top": counts.most_common(6)})
    n_prefill = -(-prompt_len // chunk)
    prefill, decode = steps[:n_prefill], steps[n_prefill:]
    # steady state: steps that compiled nothing new
    warm = [s for s in steps if s["new_distinct"] == 0]
    per = [s["s"] / s["dispatches"] for s in warm]
    return {"model": name, "n_layers": cfg.n_layers, "prompt_len": prompt_len, "chunk": chunk,
            "decode_tokens": decode_tokens, "steps": steps,
            "prefill_dispatches_per_chunk": int(np.median([s["dispatches"] for s in prefill])) if prefill else None,
            "decode_dispatches_per_step": int(np.median([s["dispatches"] for s in decode])) if decode else None,
            "distinct_primitive_shapes": len(seen),
            "steady_us_per_dispatch": round(1e6 * float(np.median(per)), 2) if per else None,
            "steady_decode_step_s": float(np.median([s["s"] for s in decode if s["new_distinct"] == 0]))
            if any(s["new_distinct"] == 0 for s in decode) else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,medium-narrow", help="presets, or PRESET-narrow (small widths)")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--decode-tokens", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--compilation-cache", default=None,
                    help="persistent compilation cache dir (as an eager server uses it): run twice to see a restart")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from bench.common import write_result

    if a.compilation_cache:
        from serving.engine.engine import use_compilation_cache

        use_compilation_cache(a.compilation_cache, "eager")

    rows = []
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        print(f"{name}: one request of {a.prompt_len} tokens + {a.decode_tokens} outputs, eager (day-0)",
              file=sys.stderr)
        rows.append(dict(measure(name, a.prompt_len, a.decode_tokens, a.chunk),
                         compilation_cache=a.compilation_cache))
    if a.out:
        write_result(a.out, {"models": rows}, "python -m bench.eager_ops " + " ".join(argv or sys.argv[1:]))
    print(f"{'model':>14} {'layers':>6} {'prefill disp.':>13} {'decode disp.':>12} {'distinct':>9} "
          f"{'us/disp.':>9} {'decode step s':>13} {'first step s':>12}")
    for r in rows:
        print(f"{r['model']:>14} {r['n_layers']:>6} {r['prefill_dispatches_per_chunk'] or '-':>13} "
              f"{r['decode_dispatches_per_step'] or '-':>12} {r['distinct_primitive_shapes']:>9} "
              f"{r['steady_us_per_dispatch'] or '-':>9} {r['steady_decode_step_s'] or '-':>13} "
              f"{r['steps'][0]['s']:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
