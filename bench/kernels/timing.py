"""The timing runner shared by the per-kernel benchmarks (gemm.py, moe.py) and the all-kernel table (all.py).

`wall_us` = median wall time of synced calls (includes ~10-40 us of dispatch); `gpu_events` = the GPU events of a
profiler trace; `device_us` = device busy time per call from such a trace (union of the GPU's kernel/memcpy
intervals / calls; None if the trace has no device plane); `run(cases, argv, prog)` = the
`--iters/--only/--sweep/--out/--smoke` CLI over a kernel's `cases(smoke)` (--smoke: its tiny shapes, the CPU check
of tests/test_bench_kernels.py), which prints a table last (GB/s = bytes / dev_us; HBM peak 4.8 TB/s, copy ~4.3
TB/s; rel_err = max |pallas - xla| / max |xla|).
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from bench.common import write_result


def wall_us(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def gpu_events(fn, args, iters: int) -> list[tuple[str, str, int, int]]:
    """(line name, event name, start ns, duration ns) of every GPU event in a profiler trace of `iters` calls
    (after one untraced call)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            out = None
            for _ in range(iters):
                out = fn(*args)
            jax.block_until_ready(out)
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        pd = jax.profiler.ProfileData.from_file(paths[0])
        return [(ln.name, e.name, e.start_ns, e.duration_ns) for p in pd.planes if p.name.startswith("/device:GPU")
                for ln in p.lines for e in ln.events if e.duration_ns > 0]


def device_us(fn, args, iters: int) -> float | None:
    """Device busy time per call: union of all event intervals on the GPU planes of a profiler trace / iters."""
    try:
        spans = [(s, s + dur) for _, _, s, dur in gpu_events(fn, args, iters)]
    except Exception as exc:  # noqa: BLE001 - a missing trace only loses the column
        print(f"device trace failed: {exc!r}", file=sys.stderr)
        return None
    if not spans:
        return None
    spans.sort()
    busy, (s0, e0) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > e0:
            busy += e0 - s0
            s0, e0 = s, e
        else:
            e0 = max(e0, e)
    busy += e0 - s0
    return busy / iters / 1e3


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def run(cases, argv, prog: str, sweep_fn=None):
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", default="")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: interpret mode)")
    a = ap.parse_args(argv)
    rows = []
    for c in cases(a.smoke):
        if a.only not in c["name"]:
            continue
        args = c["make_args"]()
        if a.sweep:
            res = []
            for label, fn in sweep_fn(c):
                try:
                    res.append((device_us(fn, args, a.iters) or wall_us(fn, args, a.iters), label))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    print(f"{c['name']} {label}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            res.sort()
            rows.append({"name": c["name"], "bytes": c["bytes"], "best": [(round(t, 2), lab) for t, lab in res[:3]]})
            print(c["name"], rows[-1]["best"], flush=True)
            del args
            continue
        yp, yx = c["fn_pallas"](*args), c["fn_xla"](*args)
        err = rel_err(yp, yx)
        finite = bool(np.all(np.isfinite(np.asarray(yp))))
        del yp, yx
        row = {"name": c["name"], "bytes": c["bytes"], "rel_err": err, "finite": finite}
        for k in ("pallas", "xla"):
            row[f"{k}_wall_us"] = wall_us(c[f"fn_{k}"], args, a.iters)
            row[f"{k}_dev_us"] = device_us(c[f"fn_{k}"], args, a.iters)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
        del args
    if a.out:
        write_result(a.out, {"cases": rows}, f"python -m {prog} " + " ".join(argv))
    if a.sweep:
        return rows
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"{'case':28s} {'pal_dev':>8s} {'xla_dev':>8s} {'speedup':>7s} {'GB/s':>6s} {'pal_wall':>8s} "
          f"{'xla_wall':>8s} {'rel_err':>8s}")
    for r in rows:
        pd, xd = r["pallas_dev_us"], r["xla_dev_us"]
        t = pd or r["pallas_wall_us"]
        sp = (xd / pd) if pd and xd else r["xla_wall_us"] / r["pallas_wall_us"]
        print(f"{r['name']:28s} {f(pd):>8s} {f(xd):>8s} {sp:7.2f} {r['bytes'] / t / 1e3:6.0f} "
              f"{f(r['pallas_wall_us']):>8s} {f(r['xla_wall_us']):>8s} {r['rel_err']:8.1e}"
              + ("" if r["finite"] else " NONFINITE"))
    return rows
