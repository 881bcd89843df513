"""Where Mega-mHC's time goes: one sublayer boundary (the full model's D = 5120, hc = 4) with parts of the kernel
switched off or resized, each kernel's device time read from a profiler trace, beside XLA's boundary.

    python -m bench.mega_mhc_ablation --out FILE.json        (GPU; about 2-3 minutes, mostly compilation)
    python -m bench.mega_mhc_ablation --smoke                 (CPU, interpret mode, D = 256: the script runs)

Variants (rows N = --ns; every variant computes a boundary, only the marked part changes):
- base / two_launch: pick_blocks' blocks, one launch (last-arrival epilogue) / phase 1 + phase 2 kernels;
- sinkhorn1: 1 Sinkhorn iteration instead of 20 (the epilogue's serial part shrinks; wrong values, timing only);
- no_quant: without the FP8 output;
- warps4 / dk256 / dk512: other blocks.
Per variant: loop_us (bench/fused_kernels.py `loop_us`: one program, 40 calls on 40 layers' weights), and per
kernel name the device us per call from a trace (XLA turns command buffers off while tracing). Prints a table.

    python -m bench.mega_mhc_ablation --counters --ns 1 --variants base,two_launch --out FILE.json   (GPU, ncu)

`--counters`: the script runs itself under Nsight Compute (bench/weight_gemm_counters.py's sections, metrics and
parsing; caches flushed, single cold launches) and reports per Mega-mHC launch its duration, occupancy, registers,
issue rate and top stall reasons: what a one-row boundary waits on.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict

import jax

from bench.common import write_result
from bench.fused_kernels import loop_us
from bench.kernels import mega_mhc as cases
from bench.kernels.timing import gpu_events
from pallas_kernels.mega_mhc import hc_boundary, pick_blocks


def kernel_us(fn, args, iters: int) -> dict[str, float]:
    """Device us per call of each kernel name on the trace's stream lines."""
    acc = defaultdict(float)
    for line, name, _, dur in gpu_events(fn, args, iters):
        if "stream" in line.lower():
            acc[name[:60]] += dur / 1e3 / iters
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))


def variant(name: str, n: int, d: int):
    b = pick_blocks(n, d)
    kw = dict(hc=cases.HC, iters=cases.ITERS, eps=cases.EPS, norm_eps=cases.NORM_EPS, quantize=True,
              single_launch=True, blocks=b)
    if name == "two_launch":
        kw["single_launch"] = False
    elif name == "sinkhorn1":
        kw["iters"] = 1
    elif name == "no_quant":
        kw["quantize"] = False
    elif name == "warps4":
        kw["blocks"] = dataclasses.replace(b, num_warps=4)
    elif name in ("dk256", "dk512"):
        kw["blocks"] = dataclasses.replace(b, dk=int(name[2:]))
    elif name != "base":
        raise ValueError(name)

    @jax.jit
    def f(y, h, mix, fn, scale, base, norm, layer):
        return hc_boundary(y, h, mix, fn, scale, base, norm, layer=layer, **kw)

    return f


VARIANTS = ("base", "two_launch", "sinkhorn1", "no_quant", "warps4", "dk256", "dk512")


def counters(a, argv) -> int:
    """Run this script's `--counters-child` under ncu; one row per Mega-mHC launch (2 calls per variant)."""
    import os
    import subprocess

    from bench import weight_gemm_counters as wgc

    cmd = ["ncu", "--clock-control", "none", "--target-processes", "all", "-k", "regex:^mega_mhc", "--csv",
           "--page", "details", *[x for s in wgc.SECTIONS for x in ("--section", s)], "--metrics",
           ",".join(wgc.METRICS), sys.executable, "-m", "bench.mega_mhc_ablation", "--counters-child",
           "--ns", a.ns, "--variants", a.variants]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_ALLOCATOR="platform")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
        return 1
    order = [{"n": int(n), "variant": v, "call": c} for n in a.ns.split(",") for v in a.variants.split(",")
             for c in range(2)]
    raw = wgc.parse(p.stdout)
    rows = []
    for r in raw:  # a variant launches 1 (one launch) or 2 (two_launch) kernels per call: match by kernel name
        stalls = {k: r.get(f"smsp__average_warps_issue_stalled_{k}_per_issue_active.ratio", 0.0) for k in wgc.STALLS}
        rows.append({"kernel": r["kernel"], "grid": r["grid"], "block": r["block"],
                     "us": r.get("gpu__time_duration.sum", float("nan")) / 1e3,
                     "registers": r.get("Registers Per Thread"), "achieved_occupancy": r.get("Achieved Occupancy"),
                     "issue_per_cycle": r.get("smsp__issue_active.avg.per_cycle_active"),
                     "instructions": r.get("smsp__inst_executed.sum"),
                     "top_stalls": sorted(stalls.items(), key=lambda kv: -kv[1])[:4]})
    if a.out:
        write_result(a.out, {"calls": order, "rows": rows, "raw": raw},
                     "python -m bench.mega_mhc_ablation " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"{'kernel':>16} {'grid':>12} {'us':>7} {'regs':>5} {'issue/cyc':>9}  top stalls (cycles per issue)")
    for r in rows:
        st = ", ".join(f"{k} {v:.1f}" for k, v in r["top_stalls"])
        print(f"{r['kernel'][:16]:>16} {r['grid']:>12} {r['us']:7.1f} {r['registers']!s:>5} "
              f"{r['issue_per_cycle']!s:>9}  {st}")
    return 0


def counters_child(a):
    d, n_layers = cases.FULL_D, cases.FULL_L
    for n in [int(x) for x in a.ns.split(",")]:
        args = cases.make_args(n, d, n_layers)
        for v in a.variants.split(","):
            fn = variant(v, n, d)
            for _ in range(2):
                jax.block_until_ready(fn(*args))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.mega_mhc_ablation")
    ap.add_argument("--ns", default="1,8")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--loop", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=300, help="seconds after which no new variant starts")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--counters", action="store_true", help="Nsight Compute counters per launch (GPU, ncu)")
    ap.add_argument("--counters-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.counters:
        return counters(a, argv)
    if a.counters_child:
        return counters_child(a)
    d, n_layers = (256, 2) if a.smoke else (cases.FULL_D, cases.FULL_L)
    t_end = time.perf_counter() + a.budget
    rows = []
    for n in [int(x) for x in a.ns.split(",")]:
        args = cases.make_args(n, d, n_layers)
        impls = {"xla": cases.reference, **{v: variant(v, n, d) for v in a.variants.split(",")}}
        for name, fn in impls.items():
            if time.perf_counter() > t_end:
                rows.append({"n": n, "variant": name, "error": "skipped: budget"})
                continue
            row = {"n": n, "variant": name}
            try:
                row["loop_us"] = round(loop_us(fn, args, n_layers, 1 if a.smoke else a.loop, a.reps), 2)
                if not a.smoke:
                    row["kernels_us"] = {k: round(v, 2) for k, v in kernel_us(fn, args, a.iters).items()}
            except Exception as exc:  # noqa: BLE001 - a failing variant is an error row
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
            if a.out:
                write_result(a.out, {"rows": rows}, "python -m bench.mega_mhc_ablation " + " ".join(
                    argv if argv is not None else sys.argv[1:]))
    print(f"{'N':>4} {'variant':>11} {'loop_us':>8}  kernels (device us per call)")
    for r in rows:
        ks = ", ".join(f"{k}: {v}" for k, v in list(r.get("kernels_us", {}).items())[:4])
        print(f"{r['n']:>4} {r['variant']:>11} {r.get('loop_us', r.get('error', '')):>8}  {ks}")
    return rows


if __name__ == "__main__":
    main()
