"""Host cost per decode step of a structured-output request's mask: llguidance alone vs budget-aware (issue 24).

No model: a simulated sampler drives one `GrammarState` per run and every step is timed as the engine spends it,
`fill(row)` (the mask written into the sampler's bitmask row) plus `advance(token)`. Two samplers: `newline`
(the degenerate default model: a newline whenever the grammar allows one, else a random allowed token) and
`random` (any allowed token). Per grammar (a forced tool call, a JSON schema, any JSON object) and tokenizer (the
tiny preset's byte tokenizer, 512 ids; the default model's BPE, 8192 ids), three settings: `plain` (no budget,
the mask alone; what the engine did before), `budget` (budget-aware with a generous max_tokens: mostly the free
zone), `tight` (max_tokens = the shortest completion + 8: the closing zone nearly all the time). Each run stops
when the output is complete or max_tokens is reached; rows report medians over all steps of all runs, the p90,
the worst step, and how many runs ended complete (plain runs that end at max_tokens are cut off).

    python -m bench.structured_mask_cost --out bench/results/structured_mask_cost_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "required": ["path"],
        "properties": {"path": {"type": "string"}, "lines": {"type": "integer", "minimum": 1}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "required": ["query"], "properties": {"query": {"type": "string"}}}}},
]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}}}


def one_run(compiled, budget: int | None, max_tokens: int, V: int, eos: int, pick) -> tuple[list[float], bool]:
    st = compiled.new_state(budget)
    row = np.zeros((V + 31) // 32, np.uint32)
    times = []
    for i in range(max_tokens):
        t0 = time.perf_counter()
        st.fill(row)
        bits = (row[:, None] >> np.arange(32, dtype=np.uint32)[None, :]) & 1
        allowed = np.flatnonzero(bits.reshape(-1)[:V])  # the sampler's part: not timed
        t1 = time.perf_counter()
        tok = pick(allowed, i)
        t2 = time.perf_counter()
        assert st.advance(tok), st.error
        times.append((t1 - t0) + (time.perf_counter() - t2))
        if tok == eos or st.done:
            return times, True
    return times, st.done


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6, help="runs per row (seeds)")
    ap.add_argument("--max-tokens", type=int, default=256, help="the generous budget (plain and budget rows)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    from dsv41_jax.default_model import DIR
    from serving.api import dsml
    from serving.engine.structured import GrammarCompiler, StructuredOutputs
    from serving.tokenizer import ByteTokenizer, HFTokenizer

    toks = {"byte": (ByteTokenizer(512), 512), "bpe": (HFTokenizer(str(DIR / "tokenizer.json")), 8192)}
    grammars = {"tool_required": lambda: StructuredOutputs(lark=dsml.tool_call_grammar(TOOLS, None, True)),
                "json_schema": lambda: StructuredOutputs(json=PERSON),
                "json_object": lambda: StructuredOutputs(json_object=True)}
    rows = []
    for tname, (tok, V) in toks.items():
        eos = tok.eos_token_id
        compiler = GrammarCompiler(tok, V, {eos})
        nl = tok.encode("\n")[0]
        for gname, make in grammars.items():
            t0 = time.perf_counter()
            g = compiler.compile(make())
            compile_ms = 1000 * (time.perf_counter() - t0)
            for sampler in ("newline", "random"):
                for setting in ("plain", "budget", "tight"):
                    max_tokens = min(g.min_tokens + 8, a.max_tokens) if setting == "tight" else a.max_tokens
                    steps, complete, lengths = [], 0, []
                    for seed in range(a.runs):
                        rng = np.random.default_rng(seed)
                        if sampler == "newline":
                            def pick(allowed, i, rng=rng):
                                return nl if nl in allowed else int(rng.choice(allowed))
                        else:
                            def pick(allowed, i, rng=rng):
                                return int(rng.choice(allowed))
                        times, done = one_run(g, None if setting == "plain" else max_tokens, max_tokens, V, eos,
                                              pick)
                        steps += times
                        complete += done
                        lengths.append(len(times))
                    us = np.asarray(steps) * 1e6
                    row = {"tokenizer": tname, "vocab": V, "grammar": gname, "sampler": sampler, "setting": setting,
                           "max_tokens": max_tokens, "min_tokens": g.min_tokens, "zone": g.zone,
                           "compile_ms": round(compile_ms, 1), "runs": a.runs, "complete": complete,
                           "mean_len": round(float(np.mean(lengths)), 1), "steps": len(steps),
                           "us_median": round(float(np.median(us)), 1),
                           "us_p90": round(float(np.percentile(us, 90)), 1),
                           "us_mean": round(float(np.mean(us)), 1), "us_max": round(float(np.max(us)), 1)}
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    if a.out:
        from bench.common import write_result

        write_result(a.out, {"rows": rows}, "python -m bench.structured_mask_cost " + " ".join(
            argv if argv is not None else sys.argv[1:]))
    print(f"{'tok':>4} {'grammar':>13} {'sampler':>7} {'setting':>6} {'max':>4} {'min':>4} {'done':>5} {'len':>6} "
          f"{'med us':>8} {'p90 us':>8} {'mean us':>8} {'max us':>9}")
    for r in rows:
        print(f"{r['tokenizer']:>4} {r['grammar']:>13} {r['sampler']:>7} {r['setting']:>6} {r['max_tokens']:>4} "
              f"{r['min_tokens']:>4} {r['complete']:>2}/{r['runs']:<2} {r['mean_len']:>6} {r['us_median']:>8} "
              f"{r['us_p90']:>8} {r['us_mean']:>8} {r['us_max']:>9}")
    return rows


if __name__ == "__main__":
    main()
