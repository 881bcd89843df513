"""Per-kernel profile of one decode step: which GPU kernels run, how many per step, how long.

    python -m bench.profile_decode --preset medium --weight-format bf16 --kernels xla,pallas --batch 8 \
        --out bench/results/profile_decode_medium_bf16_h200.json

For each kernel choice, an engine with only its decode program decodes `--batch` injected requests (random,
well-formed KV at `--context`, as bench/decode_itl.py) for `--steps` steps under `jax.profiler`; the device
events of the trace are grouped by kernel name: launches per step, microseconds per step, share of the step.
Writes the top 25 per side (and the totals) and prints a short table last.

With `--sources DIR`, XLA dumps the optimized HLO of every program into DIR and each kernel of the profile is
traced to the JAX source line its fusion came from (the fusion's `metadata` in the largest dumped module, the
decode program); the result gains `by_source`: kernels and microseconds per step grouped by source line, which
says where the tail of small kernels comes from (bench/hlo_sources.py).
"""

from __future__ import annotations

import argparse
import collections
import glob
import sys
import tempfile
import time

import numpy as np

from bench.decode_itl import fill_pools, inject


def device_events(trace_dir, stats: bool = False):
    """[(kernel name, duration ns)] of the trace's GPU events; with `stats`, each also carries its stats dict."""
    import jax

    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    pd = jax.profiler.ProfileData.from_file(path)
    out = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower() and "kernel" not in line.name.lower():
                continue
            for e in line.events:
                if e.duration_ns > 0:
                    out.append((e.name, e.duration_ns, {str(k): str(v) for k, v in e.stats}) if stats
                               else (e.name, e.duration_ns))
    return out


def profile(engine, B, context, steps, rng):
    import jax

    reqs = inject(engine, B, context, steps + 8, rng)
    for _ in range(4):
        engine.step()
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        jax.block_until_ready(engine.runner.pools)
        wall = (time.perf_counter() - t0) / steps
        jax.profiler.stop_trace()
        events = device_events(d)
    for r in reqs:
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    agg = collections.defaultdict(lambda: [0, 0])
    for name, ns in events:
        agg[name][0] += 1
        agg[name][1] += ns
    total_ns = sum(v[1] for v in agg.values())
    rows = sorted(({"kernel": k, "count_per_step": round(c / steps, 2), "us_per_step": round(ns / steps / 1e3, 2),
                    "share": round(ns / max(total_ns, 1), 4)} for k, (c, ns) in agg.items()),
                  key=lambda r: -r["us_per_step"])
    return {"wall_ms_per_step": round(1000 * wall, 3), "kernels_per_step": round(sum(v[0] for v in agg.values())
                                                                                 / steps, 1),
            "device_ms_per_step": round(total_ns / steps / 1e6, 3), "top25": rows[:25],
            "distinct_kernels": len(rows), "all": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.profile_decode")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--weight-format", default=None)
    ap.add_argument("--kernels", default="xla,pallas")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--sources", default="", help="dump XLA's HLO here and group kernels by JAX source line")
    a = ap.parse_args(argv)
    if a.sources:
        import os

        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={a.sources}"
                                   " --xla_dump_hlo_as_text").strip()
    import jax

    import checkpoints
    import dsv41_jax  # noqa: F401
    from bench.common import kernel_args
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.kv_format import pages_for
    from serving.engine import Engine, EngineArgs

    kw = {"weight_format": a.weight_format} if a.weight_format else {}
    cfg = ModelConfig.preset(a.preset, **kw)
    params = checkpoints.random_init(cfg, 0)
    jax.block_until_ready(params)
    mml = -(-(a.context + a.steps + 80) // 64) * 64
    res = {"preset": a.preset, "weight_format": cfg.weight_format, "batch": a.batch, "context": a.context}
    rng = np.random.default_rng(0)
    for impl in a.kernels.split(","):
        args = EngineArgs(max_model_len=mml, max_num_seqs=a.batch, max_num_batched_tokens=cfg.window_size,
                          prefill_buckets=(cfg.window_size,), decode_buckets=(a.batch,), **kernel_args(impl),
                          enable_prompt_logprobs=False, enable_prefix_caching=False,
                          num_pages=1 + a.batch * pages_for(mml))
        eng = Engine(cfg, args, params=params, progress=False, programs=lambda k: k.kind == "decode")
        fill_pools(eng)
        res[impl] = profile(eng, a.batch, a.context, a.steps, rng)
        if a.sources:
            from bench.hlo_sources import by_source

            res[impl]["by_source"] = by_source(res[impl]["all"], a.sources)
        del eng
    if a.out:
        from bench.common import write_result

        write_result(a.out, res, "python -m bench.profile_decode " + " ".join(
            argv if argv is not None else sys.argv[1:]))
    for impl in a.kernels.split(","):
        r = res[impl]
        print(f"== {impl}: {r['kernels_per_step']} kernels/step, device {r['device_ms_per_step']} ms/step, "
              f"wall {r['wall_ms_per_step']} ms/step")
        for row in r["top25"][:12]:
            print(f"  {row['us_per_step']:9.1f} us {row['count_per_step']:7.1f}x  {row['kernel'][:80]}")
        for row in r.get("by_source", [])[:30]:
            print(f"  src {row['us_per_step']:9.1f} us {row['count_per_step']:7.1f}x  {row['source'][:90]}")
    return res


if __name__ == "__main__":
    main()
