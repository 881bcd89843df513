"""What the sharded programs cost on one device, and whether the 2- and 4-device programs lower.

    python -m bench.parallel_overhead --preset medium --out bench/results/parallel_medium_h200.json

Part 1 (this host's device, one engine at a time): the same model served three ways,
  none: no mesh (the single-device programs),
  tp1:  a tensor-parallel mesh of size 1 (every TP shard_map and psum in the programs, on one device),
  dep1: a data + expert parallel mesh of size 1 (the per-rank region and the expert all-to-all; ragged on GPU);
for each, decode ITL at --batch requests and --context tokens (requests injected with random, well-formed
KV bytes as bench.decode_itl does; median wall time of Engine.step()) and prefill time of one --prefill-tokens
chunk through the CED prefill program (decoder on the last window; median of replayed calls, device-synced).
overhead = layout / none - 1 (the issue's bar: <= 5%).

Part 2 (no devices needed): the decode and prefill programs of TP2, TP4, DEP2, DEP4 lowered ahead of time for
--platform (cuda) on an abstract mesh (jax.sharding.AbstractMesh): lowering time, StableHLO size and the
collectives each program contains. Compiling needs the devices, so that is left to the multi-GPU runs.
Prints a short table last.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import re
import statistics
import sys
import time

import numpy as np

LAYOUTS = {"none": {}, "tp1": {"force_mesh": True}, "dep1": {"enable_expert_parallel": True}}
COLLECTIVE = re.compile(r"stablehlo\.(all_reduce|all_to_all|all_gather|reduce_scatter|collective_permute)"
                        r"|(ragged_all_to_all)")


def _engine(cfg, layout: str, a, programs):
    import checkpoints
    from dsv41_jax.kv_format import PAGE_TOKENS, pages_for
    from serving.engine import Engine, EngineArgs
    from serving.engine.engine import make_mesh

    mml = pages_for(a.context + a.steps + a.warmup + PAGE_TOKENS) * PAGE_TOKENS
    mml = max(mml, pages_for(a.prefill_tokens + PAGE_TOKENS) * PAGE_TOKENS)
    args = EngineArgs(max_model_len=mml, max_num_seqs=a.batch, max_num_batched_tokens=a.prefill_tokens,
                      prefill_buckets=(a.prefill_tokens,), decode_buckets=(a.batch,), kernels=a.kernels,
                      enable_prompt_logprobs=False, enable_prefix_caching=False,
                      num_pages=1 + (a.batch + 1) * pages_for(mml), **LAYOUTS[layout])
    resolved = args.resolved(cfg)
    mesh = make_mesh(resolved)
    t0 = time.perf_counter()
    params = checkpoints.random_init(cfg, 0, mesh, parallel=resolved.parallel)
    init_s = time.perf_counter() - t0
    eng = Engine(cfg, args, params=params, progress=True, programs=programs)
    return eng, init_s


def _replace_pools(eng):
    """bench.decode_itl.fill_pools writes plain arrays: put them back on the runner's shardings."""
    import jax
    from jax.sharding import NamedSharding

    r = eng.runner
    if r.mesh is not None:
        specs = r.pool_specs()
        r.pools = {k: jax.device_put(v, NamedSharding(r.mesh, specs[k])) for k, v in r.pools.items()}


def prefill_ms(eng, tokens: int, reps: int) -> float:
    """Median device time of the CED prefill program on one `tokens`-token prompt (replayed, synced)."""
    import jax

    from dsv41_jax.kv_format import pages_for
    from serving.engine.chunk_plan import DEC_WINDOW
    from serving.engine.step_io import PREFILL, ProgramKey

    r = eng.runner
    key = ProgramKey(PREFILL, tokens, DEC_WINDOW)
    inp = r.inputs(key)
    rng = np.random.default_rng(1)
    pages = eng.pool.allocate(pages_for(tokens))
    inp.slots[0] = eng.scheduler.free_slots[-1]
    inp.page_table[0, :len(pages)] = pages
    inp.chunk.tokens[0] = rng.integers(0, eng.cfg.vocab_size, tokens)
    if inp.chunk.engram_ids is not None and eng.hasher is not None:
        inp.chunk.engram_ids[0] = eng.hasher.hash_ids(inp.chunk.tokens[:1], None)[0]
    inp.chunk.n_valid[0] = tokens
    inp.chunk.dec_clip[0] = max(tokens - eng.cfg.window_size, 0)
    out = r.run(key, inp)
    jax.block_until_ready(r.pools)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = r.run(key, inp)
        jax.block_until_ready(r.pools)
        if out is not None:
            jax.block_until_ready(out.packed)
        ts.append(time.perf_counter() - t0)
    eng.pool.release(pages)
    return 1000 * statistics.median(ts)


def part1(cfg, a, t_start: float) -> list[dict]:
    import jax

    from bench.decode_itl import fill_pools, measure

    rows = []
    for layout in a.layouts.split(","):
        if a.budget and time.perf_counter() - t_start > a.budget:
            print(f"budget exhausted: skipping {layout}", file=sys.stderr, flush=True)
            continue
        print(f"[{layout}] building", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        eng, init_s = _engine(cfg, layout, a, lambda k: k.kind == "decode" or k.decoder == "window")
        build = time.perf_counter() - t0
        fill_pools(eng)
        _replace_pools(eng)
        ts, host_ms = measure(eng, a.batch, a.context, a.steps, a.warmup, np.random.default_rng(0))
        pf = prefill_ms(eng, a.prefill_tokens, a.prefill_reps)
        rows.append({"layout": layout, "batch": a.batch, "context": a.context,
                     "itl_ms": round(1000 * statistics.median(ts), 3),
                     "itl_ms_p90": round(1000 * float(np.percentile(ts, 90)), 3), "host_ms_per_step": round(host_ms, 3),
                     "prefill_tokens": a.prefill_tokens, "prefill_ms": round(pf, 2), "init_s": round(init_s, 1),
                     "build_s": round(build, 1), "compiled_programs": eng.runner.compile_count})
        print(rows[-1], file=sys.stderr, flush=True)
        params, pools = eng.runner.params, eng.runner.pools
        del eng
        gc.collect()
        for x in jax.tree.leaves((params, pools)):
            if not x.is_deleted():
                x.delete()
        del params, pools
        gc.collect()
    base = next((r for r in rows if r["layout"] == "none"), None)
    for r in rows:
        if base is not None:
            r["itl_overhead"] = round(r["itl_ms"] / base["itl_ms"] - 1, 4)
            r["prefill_overhead"] = round(r["prefill_ms"] / base["prefill_ms"] - 1, 4)
    return rows


def part2(cfg, a) -> list[dict]:
    from dsv41_jax.kv_format import PAGE_TOKENS, pages_for
    from dsv41_jax.sharding import Parallel, check_layout
    from serving.engine import EngineArgs
    from serving.engine.chunk_plan import DEC_WINDOW
    from serving.engine.runner import Runner
    from serving.engine.step_io import DECODE, PREFILL, ProgramKey

    mml = pages_for(a.prefill_tokens + PAGE_TOKENS) * PAGE_TOKENS
    base = EngineArgs(max_model_len=mml, max_num_seqs=a.batch, max_num_batched_tokens=a.prefill_tokens,
                      prefill_buckets=(a.prefill_tokens,), decode_buckets=(a.batch,), kernels=a.kernels,
                      enable_prompt_logprobs=False).resolved(cfg)
    rows = []
    for name in a.lower.split(","):
        mode, n = ("tp", int(name[2:])) if name.startswith("tp") else ("dp", int(name[3:]))
        par = Parallel(mode, n, ep=mode == "dp", a2a="auto").resolved(a.platform)
        check_layout(cfg, par)
        runner = Runner.for_lowering(cfg, dataclasses.replace(base, parallel=par), pages_for(mml),
                                     par.abstract_mesh())
        for key in (ProgramKey(DECODE, a.batch), ProgramKey(PREFILL, a.prefill_tokens, DEC_WINDOW)):
            t0 = time.perf_counter()
            row = {"layout": par.describe(), "program": str(key), "platform": a.platform}
            try:
                txt = runner.lower(key, (a.platform,)).as_text()
                row["lowered"] = True
                row["collectives"] = dict(collections.Counter(m.group(1) or m.group(2)
                                                              for m in COLLECTIVE.finditer(txt)))
                row["hlo_chars"] = len(txt)
            except Exception as e:  # noqa: BLE001 - record what JAX refused
                row["lowered"] = False
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["lower_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.parallel_overhead")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--weight-format", default=None)
    ap.add_argument("--kernels", default="xla")
    ap.add_argument("--layouts", default="none,tp1,dep1", help="part 1 layouts (none | tp1 | dep1)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--lower", default="tp2,tp4,dep2,dep4", help="part 2 layouts ('' skips)")
    ap.add_argument("--platform", default="cuda")
    ap.add_argument("--budget", type=float, default=420, help="start no part-1 layout after this many s (0: none)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    import dsv41_jax  # noqa: F401
    from dsv41_jax.config import ModelConfig

    kw = {"weight_format": a.weight_format} if a.weight_format else {}
    cfg = ModelConfig.preset(a.preset, **kw)
    t0 = time.perf_counter()
    lowered = part2(cfg, a) if a.lower else []
    measured = part1(cfg, a, t0) if a.layouts else []
    result = {"preset": a.preset, "weight_format": cfg.weight_format, "kernels": a.kernels, "single_device": measured,
              "lowered": lowered, "total_s": round(time.perf_counter() - t0, 1)}
    if a.out:
        from bench.common import write_result

        write_result(a.out, result, "python -m bench.parallel_overhead " + " ".join(
            argv if argv is not None else sys.argv[1:]))
    print(f"\n{'layout':7} {'itl ms':>8} {'Δitl':>7} {'prefill ms':>11} {'Δprefill':>9}")
    for r in measured:
        print(f"{r['layout']:7} {r['itl_ms']:8.2f} {r.get('itl_overhead', 0):+7.1%} {r['prefill_ms']:11.1f} "
              f"{r.get('prefill_overhead', 0):+9.1%}")
    print(f"\n{'lowered':7} {'program':32} {'ok':3} {'s':>5}  collectives")
    for r in lowered:
        print(f"{r['layout']:7} {r['program']:32} {'yes' if r['lowered'] else 'NO':3} {r['lower_s']:5.1f}  "
              f"{r.get('collectives', r.get('error', ''))}")


if __name__ == "__main__":
    main()
