"""Greedy loops of the default model: the engine as served against the exact full-sequence forward.

    python -m bench.greedy_loops --out bench/results/greedy_loops_default_cpu.json

The 20 held-out prefixes of the default model's training.json (the ones tests/test_default_model_generation.py
continues) are continued greedily for `--new` tokens twice: (a) through the serving engine with the tests' engine
shapes (bounded replay, CED trimming, the KV cache), and (b) by `dsv41_jax.paths.forward` over the whole sequence
at every step (no cache, the decoder on every row: the model's exact greedy path; prefixes right-padded to one
length, which a causal model never reads). For each prefix: the longest run of identical lines (the test's
measure, its bar is 8) on each path, and the first token where the two paths differ. Says whether a loop is the
model's (it loops on both paths) or comes from the float order of one path (greedy decoding is chaotic: one
changed argmax changes everything after it). Prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from tqdm import tqdm

MAX_RUN = 8  # issue 24's bar (tests/test_default_model_generation.py)
# The engine shapes of the tests that generate with the default model (tests/harness.py DEFAULT_MODEL_ENGINE_ARGS):
# greedy rows depend on the compiled programs' shapes through float order, so the loop test is reproduced with them.
ENGINE_ARGS = dict(max_model_len=2048, max_num_seqs=10, max_num_batched_tokens=256, prefill_buckets=(256,),
                   decode_buckets=(10,), enable_prompt_logprobs=False)


def longest_run(lines: list[str]) -> int:
    best = run = 0
    for i, line in enumerate(lines):
        run = run + 1 if i and line == lines[i - 1] else 1
        best = max(best, run)
    return best


def runs_of(prefixes, texts) -> list[int]:
    """Longest run of identical lines of each continuation, counted from the prefix's last (partial) line."""
    return [longest_run([x.rstrip() for x in (p.rsplit("\n", 1)[-1] + t).split("\n")])
            for p, t in zip(prefixes, texts)]


def engine_greedy(model_dir, prompts, new: int, engine_kw: dict) -> list[list[int]]:
    from serving.engine.config import EngineArgs, shared_cache_dir
    from serving.engine.engine import Engine
    from serving.engine.types import SamplingParams

    eng = Engine(str(model_dir), EngineArgs(**engine_kw, compilation_cache_dir=shared_cache_dir()), progress=False)
    for i, ids in enumerate(prompts):
        eng.add_request(f"p{i}", ids, SamplingParams(max_tokens=new, temperature=0))
    out = {f"p{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += list(o.new_token_ids)
    return [out[f"p{i}"] for i in range(len(prompts))]


def forward_greedy(cfg, params, prompts, new: int) -> list[list[int]]:
    """Greedy decoding by the full-sequence forward, recomputed every step on [n_prompts, max_len + new]."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax import paths

    cur = np.array([len(p) for p in prompts])
    toks = np.zeros((len(prompts), int(cur.max()) + new), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    fwd = jax.jit(lambda p, t, e: paths.forward(cfg, p, t, engram_ids=e))
    rows = np.arange(len(prompts))
    gen = [[] for _ in prompts]
    for _ in tqdm(range(new), desc="full-sequence forward", unit="token"):
        logits = fwd(params, jnp.asarray(toks), paths.engram_ids(cfg, toks))
        nxt = np.asarray(jnp.argmax(logits[rows, cur - 1], axis=-1))
        toks[rows, cur] = nxt
        for i, t in enumerate(nxt):
            gen[i].append(int(t))
        cur += 1
    return gen


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.greedy_loops")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prefix (the test's 128)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    from checkpoints.loader import load
    from dsv41_jax.default_model import DIR
    from serving.tokenizer import load_tokenizer

    cfg, params = load(str(DIR), progress=False)
    tok = load_tokenizer(str(DIR), cfg.vocab_size)
    prefixes = json.loads((DIR / "training.json").read_text())["prefixes"]
    prompts = [tok.encode(p, add_bos=True) for p in prefixes]
    t0 = time.perf_counter()
    eng = engine_greedy(DIR, prompts, a.new, ENGINE_ARGS)
    t1 = time.perf_counter()
    ref = forward_greedy(cfg, params, prompts, a.new)
    t2 = time.perf_counter()
    r_eng = runs_of(prefixes, [tok.decode(g) for g in eng])
    r_ref = runs_of(prefixes, [tok.decode(g) for g in ref])
    first = [next((i for i in range(min(len(x), len(y))) if x[i] != y[i]), min(len(x), len(y)))
             for x, y in zip(eng, ref)]
    res = {"prefixes": len(prefixes), "new_tokens": a.new, "max_run_bar": MAX_RUN,
           "engine_runs": r_eng, "forward_runs": r_ref,
           "engine_over_bar": sum(r > MAX_RUN for r in r_eng), "forward_over_bar": sum(r > MAX_RUN for r in r_ref),
           "first_difference": first, "identical": sum(f >= a.new for f in first),
           "token_agreement": float(np.mean([x == y for e, r in zip(eng, ref) for x, y in zip(e, r)])),
           "engine_s": round(t1 - t0, 1), "forward_s": round(t2 - t1, 1),
           "engine_tokens": eng, "forward_tokens": ref}
    if a.out:
        from bench.common import write_result

        write_result(a.out, res, "python -m bench.greedy_loops " + " ".join(argv if argv is not None
                                                                              else sys.argv[1:]))
    print(f"{'prefix':>6} {'engine run':>10} {'forward run':>11} {'first diff':>10}")
    for i, (x, y, f) in enumerate(zip(r_eng, r_ref, first)):
        print(f"{i:6d} {x:10d} {y:11d} {f:10d}")
    print(f"over {MAX_RUN} lines: engine {res['engine_over_bar']}, forward {res['forward_over_bar']} of "
          f"{len(prefixes)}; identical continuations {res['identical']}; token agreement "
          f"{res['token_agreement']:.3f}")
    return res


if __name__ == "__main__":
    main()
