"""Speculative decoding: served tokens/s per user with and without it (CPU), and the step costs that decide its
speedup on a GPU (computed, not served).

    python -m bench.spec_decode --mode serve --out bench/results/spec_decode_default_cpu.json
    python -m bench.spec_decode --mode cost --preset medium --out $OUT/spec_decode_medium_h200.json
    python -m bench.spec_decode --mode cost --smoke            # CPU check of the cost mode (tiny, seconds)

--mode serve (default: the embedded default model, CPU): held-out standard-library files (training.corpus, the
split the model never trained on) as prompts, greedy, batch 1 and 8, each run twice in one engine: plain decoding
(the proposer drafts nothing: decode[B] programs) and speculative decoding (--method: ngram = prompt lookup;
dspark when the model carries a draft). Tokens/s per user = (output tokens - 1) / (last token time - first token
time) per request, mean over requests (prefill excluded). The acceptance per position and the mean acceptance
length come from the engine's vllm:spec_decode_* counters.

--mode cost (medium, random weights, the GPU): B requests are injected at position --context with random,
well-formed KV bytes (bench.decode_itl.fill_pools / inject); per batch B in --batches, the median engine step
of plain decoding (decode[B]) and of a verification (verify[B], k + 1 rows per request, every request with k
drafts), and the draft step: DSpark's write_context + propose alone at batch B (when dsv41_jax.dspark exists and
the preset has a draft), or the ngram proposer's host time for B requests of this context. The implied speedup
at an acceptance vector a (per position, unconditional: P(draft i accepted); default the [0.82, 0.62, 0.42,
0.25, 0.12] quoted for V4.1-Flash's DSpark) is L * t_decode / (t_verify + t_draft), L = 1 + sum(a): computed
from measured costs, not served (random weights accept nothing). About 4-5 minutes on one H200 with a cold
compilation cache (6 medium programs + 3 draft programs; the shared cache makes a rerun faster), the
measurements capped by --budget; a failing case prints an error row and the run goes on (a kernel choice that
refuses the verify shape falls back to XLA and says so). Prints a short table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

QUOTED_ACCEPTANCE = (0.82, 0.62, 0.42, 0.25, 0.12)  # V4.1-Flash DSpark, per position (vllm-ascend PR #12968)


def _argv(argv):
    return " ".join(argv if argv is not None else sys.argv[1:])


# ----------------------------------------------------------------------------- serve (CPU)
def heldout_prompts(tok, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens: the starts of held-out standard-library files (long enough ones)."""
    from training import corpus

    files = corpus.split(corpus.list_files(tests=False))["heldout"]
    out = []
    for f in files:
        ids = tok.encode(f.text())
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} held-out files have {length} tokens")
    return out


class _Off:
    method = "off"

    def propose(self, req, k):
        return []


def serve_run(eng, prompts, max_tokens: int, tag: str) -> dict:
    """All prompts at once, greedy: per-request decode tokens/s and the spec counters' deltas."""
    from serving.engine import SamplingParams

    c0 = dict(eng.metrics.snapshot()["counters"])
    p0 = list(eng.metrics.snapshot()["spec_per_pos"])
    first, last, count = {}, {}, {}
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        cache_salt=tag)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] = count.get(o.request_id, 0) + len(o.new_token_ids)
    wall = time.perf_counter() - t0
    tps = [(count[r] - 1) / (last[r] - first[r]) for r in count if last[r] > first[r]]
    snap = eng.metrics.snapshot()
    c1, p1 = snap["counters"], snap["spec_per_pos"]
    drafts = c1.get("spec_drafts", 0) - c0.get("spec_drafts", 0)
    acc = c1.get("spec_accepted_tokens", 0) - c0.get("spec_accepted_tokens", 0)
    out = {"requests": len(prompts), "tokens": sum(count.values()), "wall_s": round(wall, 2),
           "tokens_per_s_per_user": round(statistics.mean(tps), 2) if tps else None, "drafts": drafts,
           "draft_tokens": c1.get("spec_draft_tokens", 0) - c0.get("spec_draft_tokens", 0), "accepted": acc}
    if drafts:
        out["mean_acceptance_length"] = round(1 + acc / drafts, 3)
        out["acceptance_per_position"] = [round((b - a) / drafts, 3) for a, b in zip(p0, p1)]
    return out


def serve(a, argv):
    import os

    import jax

    import dsv41_jax  # noqa: F401
    from serving.engine import Engine, EngineArgs
    from serving.engine.engine import load_model
    from serving.engine.spec_decode import make_proposer
    from serving.tokenizer import load_tokenizer

    if a.smoke:
        a.model, a.prompt_len, a.max_tokens, a.batches = "tiny", 48, 24, "1,2"
    path = a.model if a.model != "default" else os.path.join(os.path.dirname(dsv41_jax.__file__), "default_model")
    cfg, params = load_model(path)
    tok = load_tokenizer(os.path.join(path, "tokenizer.json"), cfg.vocab_size) if os.path.isdir(path) else None
    batches = [int(x) for x in a.batches.split(",")]
    spec = {"method": a.method, "num_speculative_tokens": a.k}
    if a.method == "ngram":
        spec.update(prompt_lookup_min=a.lookup_min, prompt_lookup_max=a.lookup_max)
    W = cfg.window_size
    chunk = max(W, 1 << (a.prompt_len - 1).bit_length())
    args = EngineArgs(max_model_len=a.prompt_len + a.max_tokens + 64, max_num_seqs=max(batches),
                      max_num_batched_tokens=chunk, prefill_buckets=(chunk,),
                      decode_buckets=tuple(batches), enable_prompt_logprobs=False,
                      speculative_config=__import__("json").dumps(spec))
    t0 = time.perf_counter()
    eng = Engine(cfg, args, params=params, tokenizer=tok, progress=not a.smoke)
    build = time.perf_counter() - t0
    if tok is not None and not a.smoke:
        prompts = heldout_prompts(tok, max(batches), a.prompt_len)
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, cfg.vocab_size, a.prompt_len).tolist() for _ in range(max(batches))]
    spec_prop = make_proposer(eng.args.speculative)
    for B in batches:  # warm-up of every program both modes time: first executions run slower (loads, caches)
        for mode in ("plain", "spec"):
            eng.proposer = _Off() if mode == "plain" else spec_prop
            serve_run(eng, prompts[:B], 8, f"warmup-{mode}-{B}")
    rows = []
    for B in batches:
        for mode in ("plain", "spec"):
            eng.proposer = _Off() if mode == "plain" else spec_prop
            try:
                r = serve_run(eng, prompts[:B], a.max_tokens, f"{mode}-{B}")
            except Exception as e:  # noqa: BLE001 - an error row, the run goes on
                r = {"error": f"{type(e).__name__}: {e}"}
            rows.append({"batch": B, "mode": mode, **r})
            print(rows[-1], file=sys.stderr, flush=True)
    res = {"model": a.model, "method": a.method, "k": a.k, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
           "engine_build_s": round(build, 1), "devices": str(jax.devices()[0]), "rows": rows}
    if a.out:
        from bench.common import write_result

        write_result(a.out, res, "python -m bench.spec_decode " + _argv(argv))
    print(f"{'B':>3} {'mode':>6} {'tok/s/user':>10} {'accept len':>10}  per position")
    for r in rows:
        print(f"{r['batch']:>3} {r['mode']:>6} {str(r.get('tokens_per_s_per_user', r.get('error'))):>10} "
              f"{str(r.get('mean_acceptance_length', '-')):>10}  {r.get('acceptance_per_position', '')}")
    return res


# ----------------------------------------------------------------------------- cost (GPU)
class _Random:
    """k random drafts for every request (a verification's cost does not depend on what it accepts)."""
    method = "random"

    def __init__(self, vocab: int):
        self.rng, self.vocab = np.random.default_rng(0), vocab

    def propose(self, req, k):
        return self.rng.integers(0, self.vocab, k).tolist()


def _steps(eng, B, context, steps, warmup, rng, k):
    """Median engine step with B requests injected at `context` (aborted afterwards, also on a failure)."""
    from bench.decode_itl import inject
    from serving.engine.spec_decode import SpecStats

    reqs = inject(eng, B, context, (steps + warmup + 2) * (k + 1), rng)
    try:
        for r in reqs:
            r.out.spec = SpecStats(k)
        for _ in range(warmup):
            eng.step()
        ts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    finally:
        for r in reqs:
            eng.abort(r.request_id)
        while eng.has_unfinished():
            eng.step()


def draft_cost(cfg, params, B: int, k: int, reps: int) -> float | None:
    """Seconds of one DSpark draft step at batch B: write_context of k + 1 rows, then propose k (None: no draft)."""
    import importlib.util

    if importlib.util.find_spec("dsv41_jax.dspark") is None or not getattr(cfg, "has_draft", False):
        return None
    import jax
    import jax.numpy as jnp

    from dsv41_jax import dspark
    from dsv41_jax.layers import cdtype

    W, T = cfg.window_size, k + 1
    rings = dspark.DraftRings.init(cfg, B)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 1, (B, T, len(cfg.dspark_target_layer_ids) * cfg.dim)), cdtype(cfg))
    pos = jnp.asarray(4096 + np.arange(T)[None].repeat(B, 0), jnp.int32)
    valid = jnp.ones((B, T), bool)
    anchor = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
    # the parameters are arguments, never closed over: a closure would embed them in the program as constants
    rings = jax.jit(lambda p, r: dspark.write_context(cfg, p, r, jnp.tile(x, (1, W // T + 1, 1))[:, :W],
                                                      (pos[:, :1] - W + jnp.arange(W))[:, :W],
                                                      jnp.ones((B, W), bool)))(params, rings)

    @jax.jit
    def step(p, r, x, pos, valid, anchor, key):
        r = dspark.write_context(cfg, p, r, x, pos, valid)
        return dspark.propose(cfg, p, r, anchor, pos[:, -1] + 1, key, jnp.zeros((B,)), k=k).tokens

    key = jax.random.key(0)
    jax.block_until_ready(step(params, rings, x, pos, valid, anchor, key))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, rings, x, pos, valid, anchor, key))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def ngram_cost(B: int, context: int, k: int, reps: int = 5) -> float:
    """Host seconds of the ngram proposer for B requests of `context` tokens (no match: the full scan)."""
    from serving.engine.spec_decode import ngram_draft

    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1 << 30, context).tolist() for _ in range(B)]
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for s in seqs:
            ngram_draft(s, k, 2, 5)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _save_cost(a, argv, eng, acc, L, build, build_error, rows) -> dict:
    res = {"preset": a.preset, "kernels": eng.args.kernels, "acceptance": acc, "mean_acceptance_length": L,
           "engine_build_s": round(build, 1), "build_error": build_error,
           "note": "implied speedup computed from measured step costs at the "
           "given acceptance (random weights accept nothing), not served", "rows": rows}
    if a.out:
        from bench.common import write_result

        write_result(a.out, res, "python -m bench.spec_decode " + _argv(argv))
    return res


def cost(a, argv):
    import dataclasses
    import os

    import jax

    import checkpoints
    import dsv41_jax  # noqa: F401
    from bench.decode_itl import fill_pools
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.kv_format import pages_for
    from serving.engine import Engine, EngineArgs
    from serving.engine.config import shared_cache_dir
    from serving.engine.step_io import DECODE, VERIFY

    if a.smoke:
        a.preset, a.batches, a.context, a.steps, a.warmup, a.budget = "tiny", "1,2", 96, 3, 1, 0
    batches = [int(x) for x in a.batches.split(",")]
    acc = [float(x) for x in a.acceptance.split(",")][:a.k]
    L = 1 + sum(acc)
    cfg = ModelConfig.preset(a.preset, **({"max_seq_len": max(a.context * 2, 512)} if a.smoke else {}))
    params = checkpoints.random_init(cfg, 0)
    jax.block_until_ready(params)
    mml = -(-(a.context + (a.steps + a.warmup + 4) * (a.k + 1) + 64) // 64) * 64
    os.makedirs(shared_cache_dir(), exist_ok=True)
    args = EngineArgs(max_model_len=mml, max_num_seqs=max(batches), max_num_batched_tokens=cfg.window_size,
                      prefill_buckets=(cfg.window_size,), decode_buckets=tuple(batches), kernels=a.kernels,
                      enable_prompt_logprobs=False, enable_prefix_caching=False,
                      num_pages=1 + max(batches) * pages_for(mml), compilation_cache_dir=shared_cache_dir(),
                      speculative_config=f'{{"method": "ngram", "num_speculative_tokens": {a.k}}}')
    t0 = time.perf_counter()
    build_error = None
    try:
        eng = Engine(cfg, args, params=params, progress=not a.smoke, programs=lambda k: k.kind in (DECODE, VERIFY))
    except Exception as e:  # noqa: BLE001 - e.g. a kernel that refuses the verify shape: say so, measure with XLA
        build_error = f"--kernels {a.kernels}: {type(e).__name__}: {str(e)[:300]}"
        print(f"engine build failed ({build_error}); retrying with --kernels xla", file=sys.stderr, flush=True)
        eng = Engine(cfg, dataclasses.replace(args, kernels="xla"), params=params, progress=not a.smoke,
                     programs=lambda k: k.kind in (DECODE, VERIFY))
    build = time.perf_counter() - t0
    fill_pools(eng)
    t_start = time.perf_counter()  # the budget counts the measurements (the build is bounded by its programs)
    rng = np.random.default_rng(0)
    rows, res = [], {}
    for B in batches:
        row = {"batch": B, "context": a.context, "k": a.k}
        if a.budget and time.perf_counter() - t_start > a.budget:
            rows.append({**row, "error": "budget exhausted"})
            continue
        for name, prop in (("decode_ms", _Off()), ("verify_ms", _Random(cfg.vocab_size))):
            eng.proposer = prop
            try:
                row[name] = round(1000 * _steps(eng, B, a.context, a.steps, a.warmup, rng, a.k), 3)
            except Exception as e:  # noqa: BLE001
                row[name] = None
                row["error"] = f"{name}: {type(e).__name__}: {e}"
        try:
            d = draft_cost(cfg, params, B, a.k, a.steps)
            row["draft"] = "dspark" if d is not None else "ngram (host)"
            row["draft_ms"] = round(1000 * (d if d is not None else ngram_cost(B, a.context, a.k)), 3)
        except Exception as e:  # noqa: BLE001
            row["draft_ms"] = None
            row["error"] = f"draft: {type(e).__name__}: {e}"
        if row.get("decode_ms") and row.get("verify_ms") and row.get("draft_ms") is not None:
            row["verify_over_decode"] = round(row["verify_ms"] / row["decode_ms"], 3)
            row["implied_speedup"] = round(L * row["decode_ms"] / (row["verify_ms"] + row["draft_ms"]), 3)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
        res = _save_cost(a, argv, eng, acc, L, build, build_error, rows)  # after each row: a timeout keeps them
    print(f"acceptance {acc} -> mean accepted length {L:.2f} (computed, not served)")
    print(f"{'B':>3} {'decode ms':>9} {'verify ms':>9} {'draft ms':>8} {'draft':>12} {'speedup':>7}")
    for r in rows:
        sp = r.get("implied_speedup", r.get("error"))
        print(f"{r['batch']:>3} {str(r.get('decode_ms')):>9} {str(r.get('verify_ms')):>9} "
              f"{str(r.get('draft_ms')):>8} {r.get('draft', '-'):>12} {str(sp):>7}")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.spec_decode")
    ap.add_argument("--mode", choices=("serve", "cost"), default="serve")
    ap.add_argument("--model", default="default", help="serve: default (the embedded model), a preset or a directory")
    ap.add_argument("--preset", default="medium", help="cost: the preset (random weights)")
    ap.add_argument("--method", default="ngram", choices=("ngram", "dspark"))
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--batches", default=None, help="serve: 1,8; cost: 1,8,32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--acceptance", default=",".join(map(str, QUOTED_ACCEPTANCE)))
    ap.add_argument("--budget", type=float, default=150,
                    help="cost: no new batch after this many seconds of measuring (0: no limit)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (seconds)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    a.batches = a.batches or ("1,8" if a.mode == "serve" else "1,8,32")
    return serve(a, argv) if a.mode == "serve" else cost(a, argv)


if __name__ == "__main__":
    main()
