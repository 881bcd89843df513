"""Decode inter-token latency with a JSON-schema constraint against none, in one run (issues 10 and 24).

Four phases on one engine, each `--batch` concurrent requests after a `--prompt`-token prompt: `none`
(unconstrained, --tokens tokens), `json` (every request under a JSON schema whose shortest document is longer
than --tokens, so every row decodes the whole time and every step computes a grammar mask; its max_tokens leaves
the budget-aware grammar in its free zone for all --tokens tokens, and the bench aborts the request after them),
`mixed` (half of the rows constrained like `json`), and `budget` (every request under the same kind of schema with
a tight budget: max_tokens = its shortest document + 8, so the budget-aware grammar works in its closing zone
nearly all the time and steers each document shut; the row's `tokens` is what was decoded, at most --tokens,
and `complete` says every document parsed and matched the schema; for the other rows `complete` says every
request decoded exactly --tokens tokens). ITL is the time between a request's consecutive tokens as the engine
emits them (the client-visible cadence); the first --skip tokens of each request are ignored (prefill and
ramp-up). The grammar masks are computed on the host in `Engine._fill_row` and enter the compiled decode program
as an input, so the difference between the phases is the host cost of the masks (llguidance, and the closing
zone's checks in serving/engine/grammar_budget.py) and nothing else.

    python -m bench.structured_itl --preset tiny                       # CPU, ~2 min cold
    python -m bench.structured_itl --preset medium --batch 32 --tokens 128 --out bench/results/structured_itl_h200.json

Byte tokenizer on every preset (ids >= 256 are special tokens for the grammar), so on `medium` the masks span
the full 129,280-id vocabulary. Prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from serving.engine.config import KERNELS


def schema(min_items: int) -> dict:
    return {"type": "array", "minItems": min_items, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                       "ok": {"type": "boolean"}}}}


def plan(compiler, tokens: int) -> dict:
    """Schemas and budgets: `json` needs a shortest document longer than --tokens and max_tokens that keeps the
    free zone for --tokens steps; `budget` a shortest document of at most --tokens - 8 and 8 tokens of slack."""
    from serving.engine.structured import StructuredOutputs

    def compiled(k):
        return compiler.compile(StructuredOutputs(json=schema(k)))

    k = 1
    while compiled(k).min_tokens <= tokens:
        k += 1
    long_ = compiled(k)
    k_tight = max(1, max((j for j in range(1, k) if compiled(j).min_tokens <= tokens - 8), default=1))
    tight = compiled(k_tight)
    return {"json": (schema(k), long_.min_tokens + long_.zone + tokens),
            "budget": (schema(k_tight), min(tokens, tight.min_tokens + 8))}


def run_phase(eng, mode: str, batch: int, prompt_len: int, tokens: int, skip: int, seed: int, plans: dict) -> dict:
    import jsonschema

    from serving.engine.structured import StructuredOutputs
    from serving.engine.types import SamplingParams

    stamps: dict[str, list[float]] = {}
    ids: dict[str, list[int]] = {}

    def cb(out):
        if out.new_token_ids:
            stamps.setdefault(out.request_id, []).extend([time.perf_counter()] * len(out.new_token_ids))
            ids.setdefault(out.request_id, []).extend(out.new_token_ids)

    rng = np.random.default_rng(seed)
    cut = set()  # constrained `json` / `mixed` requests, aborted after --tokens tokens
    for i in range(batch):
        rid = f"{mode}-{seed}-{i}"
        constrained = mode in ("json", "budget") or (mode == "mixed" and i % 2 == 0)
        sch, max_tokens = plans["budget" if mode == "budget" else "json"] if constrained else (None, tokens)
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i, ignore_eos=True,
                            structured=StructuredOutputs(json=sch) if constrained else None)
        if constrained and mode != "budget":
            cut.add(rid)
        prompt = rng.integers(0, 256, prompt_len).tolist()
        eng.add_request(rid, prompt, sp, callback=cb)
    t0 = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        for rid in [r for r in cut if len(stamps.get(r, ())) >= tokens]:
            eng.abort(rid)
            cut.discard(rid)
    wall = time.perf_counter() - t0
    itl = []
    for rid, ts in stamps.items():
        stamps[rid] = ts = ts[:tokens]  # an aborted request may have had one more token in flight
        d = np.diff(ts[skip:])
        itl += [x for x in d if x > 0]  # tokens emitted in the same step share a stamp
    n_tok = sum(len(ts) for ts in stamps.values())
    if mode == "budget":
        def valid(out):
            try:
                jsonschema.validate(json.loads(bytes(t for t in out if t < 256).decode()), plans["budget"][0])
                return True
            except (ValueError, jsonschema.ValidationError):
                return False
        complete = len(ids) == batch and all(valid(v) for v in ids.values())
    else:
        complete = all(len(ts) == tokens for ts in stamps.values())
    return {"mode": mode, "batch": batch, "tokens": n_tok, "steps": steps,
            "itl_ms": round(1000 * float(statistics.median(itl)), 3),
            "itl_ms_p90": round(1000 * float(np.percentile(itl, 90)), 3), "tok_per_s": round(n_tok / wall, 1),
            "complete": complete}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per request")
    ap.add_argument("--skip", type=int, default=4, help="first tokens of each request left out of the ITL")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of the four phases (the first warms up)")
    ap.add_argument("--kernels", default="auto", choices=KERNELS)
    ap.add_argument("--compilation-cache-dir", default="", help="JAX persistent compilation cache ('' : off)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import jax

    import checkpoints
    import dsv41_jax  # noqa: F401
    from dsv41_jax.config import ModelConfig
    from serving.engine import Engine, EngineArgs
    from serving.engine.structured import GrammarCompiler
    from serving.tokenizer import ByteTokenizer

    cfg = ModelConfig.preset(a.preset)
    btok = ByteTokenizer(cfg.vocab_size)
    plans = plan(GrammarCompiler(btok, cfg.vocab_size, {btok.eos_token_id}), a.tokens)
    mml = -(-(a.prompt + max(a.tokens, plans["json"][1]) + 64) // 64) * 64
    cfg = ModelConfig.preset(a.preset, max_seq_len=max(cfg.max_seq_len, mml))
    t0 = time.perf_counter()
    params = checkpoints.random_init(cfg, 0)
    jax.block_until_ready(params)
    chunk = max(cfg.window_size, -(-a.prompt // 64) * 64)
    args = EngineArgs(max_model_len=mml, max_num_seqs=a.batch, max_num_batched_tokens=chunk,
                      prefill_buckets=(chunk,), decode_buckets=(a.batch,), enable_prompt_logprobs=False,
                      enable_prefix_caching=False, compilation_cache_dir=a.compilation_cache_dir or None,
                      kernels=a.kernels)
    eng = Engine(cfg, args, params=params, tokenizer=ByteTokenizer(cfg.vocab_size), progress=True)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for r in range(a.repeats):
        for mode in ("none", "json", "mixed", "budget"):
            row = run_phase(eng, mode, a.batch, a.prompt, a.tokens, a.skip, seed=100 * r, plans=plans)
            print(row, file=sys.stderr, flush=True)
            if r > 0 or a.repeats == 1:
                rows.append(dict(row, preset=a.preset, kernels=eng.args.kernels))
    base = {r["mode"]: r for r in rows}.get("none")
    for r in rows:
        r["itl_vs_none"] = round(r["itl_ms"] / base["itl_ms"], 3) if base else None
    if a.out:
        from bench.common import write_result

        write_result(a.out, {"rows": rows}, "python -m bench.structured_itl " + " ".join(
            argv if argv is not None else sys.argv[1:]))
    print(f"{'preset':>7} {'mode':>6} {'B':>3} {'tokens':>6} {'ITL ms':>8} {'p90 ms':>8} {'x none':>6} {'tok/s':>8}")
    for r in rows:
        print(f"{r['preset']:>7} {r['mode']:>6} {r['batch']:>3} {r['tokens']:>6} {r['itl_ms']:>8} {r['itl_ms_p90']:>8} "
              f"{r['itl_vs_none']:>6} {r['tok_per_s']:>8}")
    return rows


if __name__ == "__main__":
    main()
