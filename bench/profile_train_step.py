"""Where a training step's GPU time goes: the default model's trainer step, profiled kernel by kernel.

    python -m bench.profile_train_step --shape 2048x32 --steps 3 --attention flash \
        --out bench/results/profile_train_step_flash_2k_h200.json

Builds the trainer of `training.train_default` (the shipped `model_config`, `training.objective`'s step with
`--attention`), feeds it random token windows (no corpus needed: the step's cost does not depend on the ids),
compiles it, runs two warm-up steps, then `--steps` steps under `jax.profiler`. Each GPU kernel of the trace is
mapped to the optimized HLO instruction it runs and, through that instruction's op_name, to the model's named
scopes (`SCOPES`: hc_attn, attention/indexer, moe, head, ...; "(bwd)" for the backward pass). Writes kernels per
step, device and wall time per step, tokens per second, and the top kernels, scopes and model parts by device
time; prints a short table last.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time

import numpy as np

from bench.common import write_result
from bench.hlo_sources import instruction_metadata, kernel_name
from bench.profile_decode import device_events

# the named scopes of dsv41_jax/model.py and training/objective.py, innermost last
SCOPES = ("qat_view", "engram", "hc_attn", "attention", "compress", "indexer", "indexer_kl", "core", "hc_ffn", "moe",
          "head", "loss", "optimizer")


def scope_of(op_name: str) -> str:
    """'attention/indexer (bwd)' from a JAX op_name: the model's named scopes in it, and whether it runs in the
    backward pass (a transpose of the forward)."""
    parts = [p for p in re.split(r"[/()]", op_name) if p in SCOPES]
    name = "/".join(dict.fromkeys(parts)) or "(other)"
    return name + (" (bwd)" if "transpose(" in op_name else "")


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Kernel name of each instruction (bench/hlo_sources.py) -> its scope (scope_of)."""
    return {k: scope_of(op) for k, (op, _) in instruction_metadata(hlo_text.splitlines()).items()}


def _scope(kernel: str, scopes: dict[str, str]) -> str:
    if kernel in scopes:
        return scopes[kernel]
    base = re.sub(r"(__\d+|_\d+)$", "", kernel)  # a second specialisation of a Triton kernel: name__2
    return scopes.get(base, "(unmapped)")


def device_kernels(trace_dir):
    """[(kernel name, its 'hlo_op' stat or "", duration ns, stats)] of the trace's GPU events (library kernels,
    cuBLAS and cuDNN, are named by the library; inside a command buffer 'hlo_op' names the buffer)."""
    return [(name, st.get("hlo_op", ""), ns, st) for name, ns, st in device_events(trace_dir, stats=True)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048x32", help="TxB: tokens per sequence x sequences")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--attention", default="blocked")
    ap.add_argument("--head", default="f32", choices=("f32", "bf16"), help="the LM head GEMM's operands")
    ap.add_argument("--aux-stride", type=int, default=16)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--dump", default="", help="directory: write the optimized HLO and the events (gzip) there")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from dsv41_jax.engram_hash import EngramHasher
    from training import data as D
    from training import objective as T
    from training.train_default import Run, model_config

    t, b = (int(x) for x in a.shape.split("x"))
    cfg = model_config()
    hasher, mesh = EngramHasher(cfg), D.data_mesh()
    h = T.Hyper(aux_stride=a.aux_stride, attention=a.attention, head_bf16=a.head == "bf16")
    run = Run(cfg, h, mesh, 0)
    rng = np.random.default_rng(0)

    def batch():
        return D.shard(mesh, D.host_batch(cfg, hasher, rng.integers(3, cfg.vocab_size, (b, t + 1), np.int32)))

    t0 = time.perf_counter()
    run.compile(hasher, (b, t))
    compile_s = time.perf_counter() - t0
    exe = run.compiled[(b, t)]
    scopes = hlo_scopes(exe.as_text())
    batches = [batch() for _ in range(a.steps + 2)]
    for i in range(2):
        jax.block_until_ready(run.step((b, t), batches[i], 1e-4))
    t0 = time.perf_counter()
    for i in range(a.steps):
        met = run.step((b, t), batches[2 + i], 1e-4)
    jax.block_until_ready(met)
    wall = (time.perf_counter() - t0) / a.steps
    print(f"{a.shape} {a.attention}: {b * t / wall:,.0f} tokens/s, {wall * 1e3:.1f} ms a step (compile "
          f"{compile_s:.0f} s)", flush=True)
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for i in range(a.steps):
            met = run.step((b, t), batches[2 + i], 1e-4)
        jax.block_until_ready(met)
        jax.profiler.stop_trace()
        events = device_kernels(d)
    if a.dump:
        import gzip
        import json
        import os

        os.makedirs(a.dump, exist_ok=True)
        with gzip.open(os.path.join(a.dump, "train_step_hlo.txt.gz"), "wt") as f:
            f.write(exe.as_text())
        agg = collections.defaultdict(lambda: [0, 0, None])
        for name, hlo, ns, st in events:
            r = agg[(name, hlo)]
            r[0], r[1], r[2] = r[0] + 1, r[1] + ns, r[2] or st
        with gzip.open(os.path.join(a.dump, "train_step_events.json.gz"), "wt") as f:
            json.dump([[k[0], k[1], c, ns, st] for k, (c, ns, st) in agg.items()], f)
    by_kernel, by_scope, by_part = (collections.defaultdict(lambda: [0, 0]) for _ in range(3))
    for name, hlo, ns, _ in events:
        sc = _scope(kernel_name(hlo), scopes) if hlo else "(unmapped)"
        sc = _scope(name, scopes) if sc == "(unmapped)" else sc
        for key, table in ((name, by_kernel), (sc, by_scope), (sc.split("/")[0].split(" ")[0], by_part)):
            table[key][0] += 1
            table[key][1] += ns
    total_ns = sum(e[2] for e in events)

    def top(table, n):
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:n]
        return [{"name": k, "count_per_step": c / a.steps, "ms_per_step": round(ns / a.steps / 1e6, 3),
                 "share": round(ns / max(total_ns, 1), 4)} for k, (c, ns) in rows]

    res = {"shape": a.shape, "tokens_per_step": b * t, "attention": a.attention, "compile_s": round(compile_s, 1),
           "wall_s_per_step": round(wall, 4), "tokens_per_s": round(b * t / wall),
           "device_s_per_step": round(total_ns / a.steps / 1e9, 4), "kernels_per_step": len(events) / a.steps,
           "distinct_kernels": len(by_kernel), "hlo_instructions": len(scopes), "ce": float(jnp.asarray(met["ce"])),
           "peak_bytes": int((jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0)),
           "top_kernels": top(by_kernel, a.top), "scopes": top(by_scope, 40), "parts": top(by_part, 20)}
    if a.out:
        args = sys.argv[1:] if argv is None else argv
        write_result(a.out, res, "python -m bench.profile_train_step " + " ".join(args))
    print(f"\n{a.shape} {a.attention}: {res['tokens_per_s']:,} tok/s, wall {wall * 1e3:.1f} ms, device "
          f"{res['device_s_per_step'] * 1e3:.1f} ms, {res['kernels_per_step']:.0f} kernels/step")
    for title, rows in (("parts", res["parts"]), ("scopes", res["scopes"][:25]), ("kernels", res["top_kernels"][:15])):
        print(f"-- {title}")
        for r in rows:
            print(f"{r['name'][:70]:<70} {r['count_per_step']:>7.0f} {r['ms_per_step']:>9.2f} ms {r['share']:.3f}")
    return res


if __name__ == "__main__":
    main()
