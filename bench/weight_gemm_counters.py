"""Hardware counters (Nsight Compute) of the weight GEMM kernels the model runs, at the full model's shapes: what
bounds them (DRAM throughput, occupancy, issue rate, stall reasons).

    python -m bench.weight_gemm_counters --out bench/results/weight_gemm_counters_h100.json [--launches 2] [--sweep]

The script runs itself under `ncu` (`--clock-control none`, kernels matched by name), `--run` being the child:
it builds the cases of bench/weight_gemm_cases.py that the model's block choice picks (`pick_moe_block` /
`tuned_moe_block`, `pick_gemm_block` / `tuned_gemm_block`) plus the swept FP8-dot default where the model keeps the
v1 kernel, and calls each `--launches` times on distinct routings / layer copies. ncu replays every kernel launch
per counter pass with the caches flushed, so durations are single cold calls (no neighbours, no L2 reuse). Rows
are matched to cases by launch order (each case launches exactly one matching kernel per call). The table: us,
GB/s of the weight bytes a call must read, DRAM throughput in % of the device's peak, achieved / theoretical
occupancy, registers, shared memory, waves, warp-instructions issued per cycle per scheduler, and the top stall
reasons (cycles per issued instruction). `--sweep`: variants of the model's blocks (K splits, warps, pipeline
depth) with fewer counters, each checked against the XLA reference on its first call. Needs `ncu` on PATH with
counter access (Firecracker machines).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import tempfile

KERNELS = r"regex:^(moe_|gemm_fp8|gemm_bf16)"
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis", "SchedulerStats")
STALLS = ("long_scoreboard", "barrier", "wait", "math_pipe_throttle", "mio_throttle", "short_scoreboard",
          "lg_throttle", "not_selected", "selected", "dispatch_stall", "no_instruction", "branch_resolving",
          "membar", "drain", "sleeping", "tex_throttle", "imc_miss")
METRICS = ["dram__bytes_read.sum", "gpu__time_duration.sum", "sm__warps_active.avg.pct_of_peak_sustained_active",
           "smsp__issue_active.avg.per_cycle_active", "smsp__inst_executed.sum",
           "launch__occupancy_per_block_size", "sm__maximum_warps_per_active_cycle_pct"] + [
    f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS]
SWEEP_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats")
SWEEP_METRICS = METRICS[:5] + [f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS[:3]]


def cases():
    """[(label, fn, arg sets)] in launch order."""
    from bench import weight_gemm_cases as wc
    from pallas_kernels.gemm.block_sizes import tuned_gemm_block
    from pallas_kernels.moe.block_sizes import tuned_moe_block

    out = []
    W = wc.MoeWeights()
    for matrix, M in (("w13+swiglu", 6), ("w13+swiglu", 48), ("w2", 6), ("w2", 48)):
        fused = matrix == "w13+swiglu"
        N, K = (wc.INTER, wc.D) if fused else (wc.D, wc.INTER)
        cs, _, _, info = wc.moe_group(W, matrix, M, with_xla=False)
        tuned = tuned_moe_block(M, N, K, info["active_experts"], fused, True)
        fp8 = [c for c in cs if c.block is not None and c.block.decode == "fp8"]
        pick = [c for c in fp8 if c.block == tuned] or fp8[:1]  # the model's block, else the swept default
        for c in [c for c in cs if c.variant == "current"] + pick:
            out.append((f"moe {matrix} M={M} {'tuned' if c.block == tuned else c.variant}", c))
    for matrix, M in (("wq_b", 1), ("wo_b", 8), ("shared_w13", 1), ("wkv", 1)):
        N, K = wc.DENSE[matrix]
        cs, _, _, _ = wc.dense_group(matrix, M, wc.dense_weights(N, K, True))
        tuned = tuned_gemm_block(M, N, K, True)
        for c in cs:
            if c.variant == "current" or (tuned is not None and c.block == tuned):
                out.append((f"dense {matrix} M={M} {'tuned' if c.block == tuned else c.variant}", c))
    return out


def _variants(base, changes):
    from dataclasses import replace

    out = [("base", base)]
    for ch in changes:
        b = replace(base, **ch)
        if all(b != o for _, o in out):
            out.append((",".join(f"{k}={v}" for k, v in ch.items()), b))
    return out


def sweep_cases(only: str = ""):
    """Variants of the model's block for the kernels whose counters say latency-bound: more programs (K splits),
    more warps, other pipeline depths. [(label, case, reference fn, reference args)]."""
    from bench import weight_gemm_cases as wc
    from pallas_kernels.gemm.block_sizes import tuned_gemm_block
    from pallas_kernels.moe.block_sizes import pick_moe_block, tuned_moe_block

    out = []
    W = wc.MoeWeights()
    pf = dict(prefetch=True)
    moe = [("w13+swiglu", 6, tuned_moe_block(6, wc.INTER, wc.D, 6, True, True),
            [pf, dict(pf, num_warps=8), dict(pf, splits=5), dict(pf, num_stages=4), dict(num_warps=8),
             dict(num_stages=4), dict(splits=5)]),
           ("w13+swiglu", 48, tuned_moe_block(48, wc.INTER, wc.D, 44, True, True), [pf, dict(pf, num_warps=8)]),
           ("w2", 6, wc.fp8_moe_block(1, wc.D, wc.INTER, 6), [pf, dict(pf, num_warps=8), dict(pf, splits=3)]),
           ("w2", 48, wc.fp8_moe_block(2, wc.D, wc.INTER, 44), [pf, dict(pf, num_warps=8)]),
           ("w2", 6, pick_moe_block(6, wc.D, wc.INTER, fp4=True, active=6),
            [dict(splits=3), dict(bk=128, splits=3), dict(num_warps=8)])]
    for matrix, M, base, changes in moe:
        if only and only not in f"moe {matrix} M={M}":
            continue
        cs, ref_fn, ref_args, _ = wc.moe_group(W, matrix, M, with_xla=False, extra=_variants(base, changes))
        tag = "v1" if base.decode != "fp8" else "fp8"
        out += [(f"moe {matrix} M={M} {tag} {c.variant}", c, ref_fn, ref_args) for c in cs if c.variant != "current"]
    dense = [("wq_b", 1, [pf, dict(pf, splits=5), dict(pf, num_stages=4), dict(splits=5), dict(num_stages=4)]),
             ("shared_w13", 1, [pf, dict(pf, num_stages=2), dict(pf, num_warps=8), dict(num_stages=2)]),
             ("wo_b", 8, [pf, dict(pf, splits=8)])]
    for matrix, M, changes in dense:
        if only and only not in f"dense {matrix} M={M}":
            continue
        N, K = wc.DENSE[matrix]
        base = tuned_gemm_block(M, N, K, True) or wc.fp8_dense_block(M, N, K)
        cs, ref_fn, ref_args, _ = wc.dense_group(matrix, M, wc.dense_weights(N, K, True),
                                                 extra=_variants(base, changes))
        out += [(f"dense {matrix} M={M} {c.variant}", c, ref_fn, ref_args) for c in cs
                if c.variant not in ("current", "xla")]
    return out


def run_child(launches: int, order_path: str, sweep: bool, only: str = ""):
    import jax
    import numpy as np

    from bench.weight_gemms import rel_err

    order, refs = [], {}
    todo = sweep_cases(only) if sweep else [(label, c, None, None) for label, c in cases()]
    for label, c, ref_fn, ref_args in todo:
        f = jax.jit(c.fn)
        err = None
        for i, a in enumerate(c.arg_sets[:launches]):
            try:
                y = jax.block_until_ready(f(*a))
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile launches nothing
                print(f"{label}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
                break
            if i == 0 and ref_fn is not None:
                key = (c.kind, c.matrix, c.M)
                if key not in refs:
                    refs[key] = np.asarray(jax.jit(ref_fn)(*ref_args), np.float64)
                err = rel_err(y, refs[key])
            order.append(dict(label=label, variant=c.variant, block=repr(c.block), nbytes=c.nbytes,
                              matrix=c.matrix, M=c.M, rel_err=err, ok=None if err is None else err <= c.tol))
    with open(order_path, "w") as fh:
        json.dump(order, fh)


def wall_times(only: str, iters: int):
    """No ncu: each sweep case whose label contains `only`, checked on its first call, then timed by wall clock
    (median of `iters` synced calls over its argument sets; launch overhead included, for side-by-side ranking);
    one line per case as it finishes."""
    import statistics
    import time

    import jax
    import numpy as np

    from bench.weight_gemms import rel_err

    refs = {}
    for label, c, ref_fn, ref_args in sweep_cases(only):
        f = jax.jit(c.fn)
        try:
            y = jax.block_until_ready(f(*c.arg_sets[0]))
        except Exception as exc:  # noqa: BLE001
            print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        key = (c.kind, c.matrix, c.M)
        if key not in refs:
            refs[key] = np.asarray(jax.jit(ref_fn)(*ref_args), np.float64)
        err = rel_err(y, refs[key])
        ts = []
        for i in range(iters):
            a = c.arg_sets[i % len(c.arg_sets)]
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts.append(time.perf_counter() - t0)
        us = statistics.median(ts) * 1e6
        print(f"WALL | {label} | {us:.1f} us | {c.nbytes / us / 1e3:.0f} GB/s | err {err:.1e} "
              f"{'ok' if err <= c.tol else 'FAIL'} |", flush=True)


def parse(csv_text: str) -> list[dict]:
    """ncu --csv --page details (+ --metrics) -> one dict per kernel launch, in launch order."""
    lines = csv_text[csv_text.find('"ID"'):]
    by_id: dict[str, dict] = {}
    for r in csv.DictReader(io.StringIO(lines)):
        d = by_id.setdefault(r["ID"], {"kernel": r["Kernel Name"], "grid": r.get("Grid Size", ""),
                                       "block": r.get("Block Size", "")})
        v = r["Metric Value"].replace(",", "")
        try:
            d[r["Metric Name"]] = float(v)
        except ValueError:
            d[r["Metric Name"]] = v
    return [by_id[k] for k in sorted(by_id, key=int)]


def summarise(rows: list[dict], order: list[dict]) -> list[dict]:
    out = []
    for r, o in zip(rows, order):
        t_ns = r.get("gpu__time_duration.sum", float("nan"))
        stalls = {s: r.get(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio", 0.0) for s in STALLS}
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:4]
        out.append(dict(o, kernel=r["kernel"], grid=r["grid"], block_dim=r["block"], us=t_ns / 1e3,
                        weight_gbps=o["nbytes"] / t_ns, dram_read_gbps=r.get("dram__bytes_read.sum", 0) / t_ns,
                        dram_pct=r.get("DRAM Throughput"), achieved_occupancy=r.get("Achieved Occupancy"),
                        theoretical_occupancy=r.get("Theoretical Occupancy"),
                        registers=r.get("Registers Per Thread"),
                        smem_kb=(r.get("Dynamic Shared Memory Per Block") or 0) / 1024, waves=r.get("Waves Per SM"),
                        issue_per_cycle=r.get("smsp__issue_active.avg.per_cycle_active"),
                        cycles_per_issue=r.get("Warp Cycles Per Issued Instruction"),
                        stalls=stalls, top_stalls=top))
    return out


def table(rows: list[dict]) -> str:
    hdr = ("| case | us | weight GB/s | DRAM % | occ. ach./theor. % | regs | smem KB | waves | issue/cyc | "
           "top stalls (cycles per issue) | rel. err |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [hdr]
    for r in rows:
        st = ", ".join(f"{k} {v:.1f}" for k, v in r["top_stalls"])
        err = "" if r.get("rel_err") is None else f"{r['rel_err']:.1e}" + ("" if r["ok"] else " FAIL")
        lines.append(f"| {r['label']} | {r['us']:.1f} | {r['weight_gbps']:.0f} | {r['dram_pct']} | "
                     f"{r['achieved_occupancy']} / {r['theoretical_occupancy']} | {r['registers']} | "
                     f"{r['smem_kb']:.0f} | {r['waves']} | {r['issue_per_cycle']} | {st} | {err} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--launches", type=int, default=2, help="calls per case (distinct routings / layer copies)")
    ap.add_argument("--run", action="store_true", help="child mode: run the cases (what ncu profiles)")
    ap.add_argument("--order", default="", help="child mode: where to write the launch order")
    ap.add_argument("--sweep", action="store_true", help="variants of the model's blocks (fewer counters)")
    ap.add_argument("--wall", default=None, help="no ncu: wall-clock the sweep cases whose label contains this")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", default="", help="--sweep: only the cases whose label contains this")
    a = ap.parse_args(argv)
    if a.run:
        run_child(a.launches, a.order, a.sweep, a.only)
        return 0
    if a.wall is not None:
        wall_times(a.wall, a.iters)
        return 0
    from bench.common import write_result

    tmp = tempfile.mkdtemp()
    order_path = os.path.join(tmp, "order.json")
    sections, metrics = (SWEEP_SECTIONS, SWEEP_METRICS) if a.sweep else (SECTIONS, METRICS)
    cmd = ["ncu", "--clock-control", "none", "--target-processes", "all", "-k", KERNELS, "--csv", "--page", "details",
           *[x for s in sections for x in ("--section", s)], "--metrics", ",".join(metrics),
           sys.executable, "-m", "bench.weight_gemm_counters", "--run", "--launches", str(a.launches),
           "--order", order_path] + (["--sweep", "--only", a.only] if a.sweep else [])
    # one allocation per buffer (not XLA's preallocated pool), so ncu's per-pass save / restore copies only buffers
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_ALLOCATOR="platform")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode or not os.path.exists(order_path):
        print(p.stdout[-4000:], p.stderr[-4000:], file=sys.stderr)
        return 1
    order = json.load(open(order_path))
    rows = parse(p.stdout)
    if len(rows) != len(order):
        print(f"warning: {len(rows)} profiled launches for {len(order)} calls; matching by order", file=sys.stderr)
    res = summarise(rows, order)
    if a.out:
        write_result(a.out, dict(rows=res, raw=rows),
                     " ".join(["python -m bench.weight_gemm_counters", *(argv or sys.argv[1:])]))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
