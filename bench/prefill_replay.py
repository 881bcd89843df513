"""Prefill time against prompt length, and warm-turn TTFT against the cached prefix length H, for CED-trimmed vs
full-depth prefill, bounded replay vs exact SWA snapshots, compiled vs eager: one Engine per configuration in
this process (like bench/engine_bench.py), the same random weights for all.

    python -m bench.prefill_replay --preset medium --out bench/results/prefill_replay_medium_h200.json
    python -m bench.prefill_replay --cpu-smoke --out /tmp/prefill_replay_cpu.json     # tiny preset, compiled

Configurations (EngineArgs overrides; the eager day-0 baseline is `bench.agentx.sides.DAY0_EAGER`, defined there):
  optimised  {}                            CED-trimmed prefill, SWA bounded replay, compiled (the defaults)
  exact      swa_bounded_replay=False      full-depth prefill (decoder on every row), exact SWA snapshots
  eager      execution=eager               CED-trimmed, bounded replay, eager
  day0       DAY0_EAGER                    full depth, snapshots, eager, XLA kernels, no scheduler knobs
  pallas     kernels=pallas                the optimised configuration with the Pallas kernels, and
  xla        kernels=xla                   with XLA's ops (the defaults' `--kernels auto` picks Pallas on a GPU)
The kernels each configuration resolved to are recorded; `pallas_over_xla_*` compares the compiled, CED,
bounded-replay configurations that ran with each.

For each H (ascending; clamped so the warm turn fits the model): turn 1 sends a fresh prompt of
P1 = H + 33 - out_tokens tokens and decodes `out_tokens` (its TTFT is the prefill time of P1 tokens); the
warm turn resends turn 1's prompt and output plus `new_tokens` fresh tokens, max_tokens 1. Turn 1 computes
H + 32 tokens, so the warm turn's prefix-cache hit is exactly H and exact mode finds its SWA snapshot at H
(turn 1's last full-page boundary): both modes get their best case; bounded replay recomputes the last
window plus the new tokens with the decoder on the last window, exact mode the new tokens at full depth.
The engine's counters give the warm turn's hit and replayed tokens. Each point is the median of `--reps`
runs (fresh prompts) after one untimed run at the smallest H (compilation, eager op caches).

`--merge A.json B.json --out C.json` combines runs made one configuration per command (the compile time of
each compiled configuration is minutes on an H200). `--budget` seconds are split between the configurations
still to run; an H whose estimated cost (the last
point's, scaled by (H/H_last)^1.5) does not fit the configuration's share is skipped and listed. The results
JSON compares: warm-turn TTFT optimised vs day0 (target: >= 70% lower at the largest H), CED vs full prefill
compiled (optimised/exact) and eager (eager/day0) (target: >= 35% faster on long prompts, never slower at the
shortest). A PNG (matplotlib, optional) plots both; a short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np

from bench.agentx.sides import DAY0_EAGER

CONFIGS = {"optimised": {}, "exact": {"swa_bounded_replay": False}, "eager": {"execution": "eager"}, "day0": DAY0_EAGER,
           "pallas": {"kernels": "pallas"}, "xla": {"kernels": "xla"}}
PAIRS = {"compiled": ("optimised", "exact"), "eager": ("eager", "day0")}  # (CED-trimmed, full depth)
DEFAULT_LENGTHS = "1024,2048,4096,8192,16384,32768,65536"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _counters(engine) -> dict:
    try:
        return dict(engine.metrics.snapshot()["counters"])
    except (AttributeError, KeyError, TypeError):
        return {}


def run_request(engine, rid: str, prompt: list[int], max_tokens: int, salt: str):
    """(TTFT seconds, generated ids, total seconds) with the engine stepped in this thread."""
    from bench.engine_bench import ttft
    from serving.engine import SamplingParams

    return ttft(engine, rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), salt)


def scenario(engine, H: int, out_tokens: int, new_tokens: int, vocab: int, rng, tag: str) -> dict:
    """Turn 1 (cold prefill) then the warm turn at cached prefix H; see the module docstring."""
    p1 = rng.integers(0, vocab, H + 33 - out_tokens).tolist()
    cold, out, _ = run_request(engine, f"{tag}-1", p1, out_tokens, tag)
    p2 = p1 + out + rng.integers(0, vocab, new_tokens).tolist()
    c0 = _counters(engine)
    warm, _, _ = run_request(engine, f"{tag}-2", p2, 1, tag)
    c1 = _counters(engine)
    hit = c1.get("prefix_cache_hits", 0) - c0.get("prefix_cache_hits", 0)
    replayed = c1.get("replayed_tokens", 0) - c0.get("replayed_tokens", 0)
    return {"prompt_len": len(p1), "cold_ttft_s": cold, "warm_prompt_len": len(p2), "warm_ttft_s": warm,
            "warm_cached": hit, "warm_replayed": replayed, "warm_recomputed": len(p2) - hit + replayed}


def engine_args(a, overrides: dict, max_model_len: int):
    from serving.engine import EngineArgs

    kw = dict(max_model_len=max_model_len, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.chunk,
              prefill_buckets=tuple(a.buckets), decode_buckets=(a.max_num_seqs,), enable_prompt_logprobs=False,
              compilation_cache_dir=a.compilation_cache_dir)
    if a.cpu_smoke:  # the shared API test server's shapes: its compiled programs are reused from the cache
        from serving.engine.config import SMALL_ENGINE_ARGS, shared_cache_dir

        kw.update(SMALL_ENGINE_ARGS, compilation_cache_dir=a.compilation_cache_dir or shared_cache_dir())
    kw.update(overrides)
    return EngineArgs(**kw)


def run_config(a, name: str, cfg, params, lengths: list[int], deadline: float, on_point=None) -> dict:
    from serving.engine import Engine

    ov = CONFIGS[name]
    res = {"overrides": ov, "decoder": "full" if ov.get("swa_bounded_replay") is False else "ced",
           "execution": ov.get("execution", "compiled"), "points": [], "skipped": []}
    ml = max(h + 33 - a.out_tokens + a.out_tokens + a.new_tokens for h in lengths)
    t0 = time.perf_counter()
    eng = Engine(cfg, engine_args(a, ov, -(-ml // 64) * 64), params=params, progress=False)
    res["build_s"] = round(time.perf_counter() - t0, 2)
    res["kernels"] = eng.args.kernels  # resolved (--kernels auto)
    res["programs"] = getattr(getattr(eng, "runner", None), "compile_count", None)
    rng = np.random.default_rng(a.seed)
    t0 = time.perf_counter()
    scenario(eng, lengths[0], a.out_tokens, a.new_tokens, cfg.vocab_size, rng, f"{name}-w")
    res["first_call_s"] = round(time.perf_counter() - t0, 2)
    last = None  # (H, seconds) of the previous point
    for H in lengths:
        est = 0.0 if last is None else last[1] * (H / last[0]) ** 1.5
        if time.perf_counter() + est > deadline:
            res["skipped"].append(H)
            continue
        t0 = time.perf_counter()
        runs = [scenario(eng, H, a.out_tokens, a.new_tokens, cfg.vocab_size, rng, f"{name}-{H}-{r}")
                for r in range(a.reps)]
        pt = {"H": H}
        for k in runs[0]:
            vals = [r[k] for r in runs]
            pt[k] = round(statistics.median(vals), 5) if k.endswith("_s") else vals[0]
        pt["cold_ttft_all_s"] = [round(r["cold_ttft_s"], 5) for r in runs]
        pt["warm_ttft_all_s"] = [round(r["warm_ttft_s"], 5) for r in runs]
        res["points"].append(pt)
        last = (H, time.perf_counter() - t0)
        print(f"  {name:>9} H={H:>6} cold {pt['cold_ttft_s']:.4f} s  warm {pt['warm_ttft_s']:.4f} s  "
              f"(cached {pt['warm_cached']}, replayed {pt['warm_replayed']})", flush=True)
        if on_point is not None:
            on_point(res)
    del eng
    gc.collect()
    return res


def compare(configs: dict) -> dict:
    def by_h(name, key):
        return {p["H"]: p[key] for p in configs.get(name, {}).get("points", []) if p.get(key)}

    out = {}
    opt, d0 = by_h("optimised", "warm_ttft_s"), by_h("day0", "warm_ttft_s")
    common = sorted(set(opt) & set(d0))
    if common:
        out["warm_ttft_reduction_vs_day0"] = {h: round(1 - opt[h] / d0[h], 4) for h in common}
        h = common[-1]
        out["warm_ttft_target"] = {"H": h, "reduction": round(1 - opt[h] / d0[h], 4), "target": 0.70,
                                   "met": 1 - opt[h] / d0[h] >= 0.70}
    ex = by_h("exact", "warm_ttft_s")
    common = sorted(set(opt) & set(ex))
    if common:  # bounded replay against exact snapshots, both compiled (day-0 adds eager execution on top)
        out["warm_ttft_reduction_vs_exact"] = {h: round(1 - opt[h] / ex[h], 4) for h in common}
    def with_kernels(k):  # the compiled CED bounded-replay configuration that ran with kernels k (files made
        for n in (k, "optimised"):  # before `--kernels auto` record none: their default was xla)
            c = configs.get(n)
            if c and c.get("kernels", "xla" if n == "optimised" else n) == k and c.get("decoder") == "ced" \
                    and c.get("execution") == "compiled":
                return n
        return None

    for key in ("cold_ttft_s", "warm_ttft_s"):
        xla, pal = by_h(with_kernels("xla"), key), by_h(with_kernels("pallas"), key)
        common = sorted(set(xla) & set(pal))
        if common:
            out[f"pallas_over_xla_{key[:-2]}"] = {h: round(pal[h] / xla[h], 4) for h in common}
    for mode, (ced, full) in PAIRS.items():
        c, f = by_h(ced, "cold_ttft_s"), by_h(full, "cold_ttft_s")
        common = sorted(set(c) & set(f))
        if not common:
            continue
        ratio = {h: round(c[h] / f[h], 4) for h in common}
        out[f"ced_over_full_prefill_{mode}"] = ratio
        out[f"ced_prefill_target_{mode}"] = {
            "longest": common[-1], "faster_by": round(1 - ratio[common[-1]], 4), "target": 0.35,
            "met_long": 1 - ratio[common[-1]] >= 0.35, "shortest": common[0],
            "not_slower_short": ratio[common[0]] <= 1.0}
    return out


def plot(res: dict, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    style = {"optimised": ("#2a7ab0", "-"), "exact": ("#d08020", "-"), "eager": ("#2a7ab0", "--"),
             "day0": ("#777777", "--"), "pallas": ("#30a050", ":"), "xla": ("#a03030", ":")}
    for name, c in res["configs"].items():
        pts = c["points"]
        if not pts:
            continue
        color, ls = style.get(name, (None, "-"))
        label = f"{name} ({c['decoder']}, {c['execution']})"
        ax[0].plot([p["prompt_len"] for p in pts], [p["cold_ttft_s"] for p in pts], "o", ls=ls, color=color,
                   label=label)
        ax[1].plot([p["H"] for p in pts], [p["warm_ttft_s"] for p in pts], "o", ls=ls, color=color, label=label)
    ax[0].set_title(f"prefill (cold TTFT) vs prompt length ({res['preset']})")
    ax[0].set_xlabel("prompt tokens")
    ax[1].set_title(f"warm-turn TTFT (+{res['new_tokens']} new tokens) vs cached prefix H")
    ax[1].set_xlabel("cached prefix H (tokens)")
    for x in ax:
        x.set_xscale("log", base=2)
        x.set_yscale("log")
        x.set_ylabel("seconds")
        x.grid(True, which="both", alpha=0.3)
        x.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def print_table(res: dict):
    print(f"{'config':>9} {'decoder':>7} {'exec':>8} {'H':>6} {'prompt':>7} {'cold s':>9} {'warm s':>9} "
          f"{'cached':>7} {'replayed':>8}")
    for name, c in res["configs"].items():
        print(f"{name:>9} engine built in {c['build_s']} s ({c['programs']} programs), first scenario "
              f"{c['first_call_s']} s")
        for p in c["points"]:
            print(f"{name:>9} {c['decoder']:>7} {c['execution']:>8} {p['H']:>6} {p['prompt_len']:>7} "
                  f"{p['cold_ttft_s']:>9.4f} {p['warm_ttft_s']:>9.4f} {p['warm_cached']:>7} {p['warm_replayed']:>8}")
        if c["skipped"]:
            print(f"{name:>9} skipped H = {c['skipped']} (budget)")
    for k, v in res["comparisons"].items():
        if k.endswith("target") or "_target_" in k or k.startswith("pallas_over"):
            print(f"{k}: {v}")


def merge(paths: list[str], out: str | None) -> dict:
    """One result from several files (same preset and sizes): configurations united, comparisons redone."""
    import json

    from bench.common import write_result

    recs = [json.load(open(p)) for p in paths]
    res = dict(recs[0]["result"], configs={})
    for r in recs:
        res["configs"].update(r["result"]["configs"])
    res["comparisons"] = compare(res["configs"])
    res["merged_from"] = [{"file": p, "device": r.get("device"), "commit": r.get("commit"), "date": r.get("date"),
                           "command": r.get("command")} for p, r in zip(paths, recs)]
    if out:
        res["png"] = plot(res, os.path.splitext(out)[0] + ".png")
        same = {k: recs[0].get(k) for k in ("device", "jax", "commit") if len({r.get(k) for r in recs}) == 1}
        same["date"] = max(r.get("date", "") for r in recs)  # the runs' device, not this process's
        write_result(out, res, command="python -m bench.prefill_replay --merge " + " ".join(paths), source=same)
    print_table(res)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium", help="a preset (random weights) or a checkpoint directory")
    ap.add_argument("--configs", default="optimised,day0,exact,eager", help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--lengths", default=DEFAULT_LENGTHS, help="cached prefix lengths H (multiples of 64)")
    ap.add_argument("--out-tokens", type=int, default=32, help="turn 1's output tokens (<= 33)")
    ap.add_argument("--new-tokens", type=int, default=256, help="fresh tokens of the warm turn")
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--buckets", default="512,2048", help="prefill buckets (the largest >= --chunk)")
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=1e9, help="wall-clock seconds for all configurations")
    ap.add_argument("--compilation-cache-dir", default=None)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny preset, H 64 and 128, configs optimised,exact, the test server's shapes")
    ap.add_argument("--out", default=None, help="results JSON (and a PNG beside it)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine result files of separate runs (e.g. one configuration per command) into --out")
    a = ap.parse_args(argv)
    if a.merge:
        return merge(a.merge, a.out)
    given = " ".join(sys.argv[1:] if argv is None else argv)
    if a.cpu_smoke:
        a.preset, a.out_tokens, a.new_tokens = "tiny", 8, 16
        if "--lengths" not in given:
            a.lengths = "64,128"
        if "--configs" not in given:  # eager on a CPU spends a minute or more compiling its ops one by one
            a.configs = "optimised,exact"
    a.buckets = _ints(a.buckets)
    if a.buckets[-1] < a.chunk:
        a.buckets.append(a.chunk)
    if not 1 <= a.out_tokens <= 33:
        ap.error("--out-tokens must be in [1, 33] (turn 1 must leave exact mode its snapshot at H)")
    import dsv41_jax  # noqa: F401  (XLA flags before the backend starts)
    from dsv41_jax.config import ModelConfig
    from serving.engine.engine import load_model

    if os.path.isdir(a.preset):  # a checkpoint directory (e.g. dsv41_jax/default_model)
        cfg, params = load_model(a.preset)
    else:
        cfg, params = ModelConfig.preset(a.preset), None
    room = cfg.max_seq_len - a.new_tokens - 64
    lengths = sorted({min(h, room // 64 * 64) for h in _ints(a.lengths)})
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    for n in names:
        if n not in CONFIGS:
            ap.error(f"unknown config {n!r}; known: {list(CONFIGS)}")
    t_start = time.perf_counter()
    if params is None:
        _, params = load_model(cfg)
    res = {"preset": a.preset, "lengths_requested": _ints(a.lengths), "lengths": lengths, "out_tokens": a.out_tokens,
           "new_tokens": a.new_tokens, "chunk": a.chunk, "buckets": a.buckets, "reps": a.reps,
           "window": cfg.window_size, "configs": {}}
    for i, name in enumerate(names):
        left = a.budget - (time.perf_counter() - t_start)
        deadline = time.perf_counter() + left / (len(names) - i)
        print(f"{name}: {CONFIGS[name] or 'server defaults'}", flush=True)
        res["configs"][name] = run_config(a, name, cfg, params, lengths, deadline, on_point=lambda c, n=name: save(
            a, dict(res, configs={**res["configs"], n: c}), given, t_start, final=False))
        save(a, res, given, t_start, final=i == len(names) - 1)  # after every configuration: a killed run keeps
    print_table(res)                                              # what it measured
    return res


def save(a, res: dict, given: str, t_start: float, final: bool):
    from bench.common import write_result

    res["comparisons"] = compare(res["configs"])
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    res["complete"] = final
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        if final:
            res["png"] = plot(res, os.path.splitext(a.out)[0] + ".png")
        write_result(a.out, res, command="python -m bench.prefill_replay " + given)


if __name__ == "__main__":
    main()
