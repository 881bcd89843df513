"""Microbenchmark cases of the small-M GEMM at V4.1 decode shapes, and the timing runner shared with moe/bench.py.

`cases()` -> list of dicts: name, fn_pallas, fn_xla (jitted callables on the args), make_args (zero-arg: random
full-shape device arrays, fixed seed), bytes (minimum bytes moved: one layer's weight (+ scales), x, y).
Cases: M in {1, 8, 32} x {wq_a 1280x5120, wq_b 32768x1280, wo_b 5120x8192, shared w1 2304x5120} x {bf16, FP8},
each weight stacked [L=4, N, K] with a layer index, so the XLA branch pays the per-layer slice the model pays.

`python -m pallas_kernels.gemm.bench [--iters N] [--only SUBSTR] [--sweep] [--out results.json]` times both on the
current device and prints a table last: wall_us = median wall time of synced calls (includes ~10-40 us of
dispatch), dev_us = device busy time per call from a profiler trace (union of the GPU's kernel/memcpy intervals
/ calls; "-" if the trace has no device plane), GB/s = bytes / dev_us (HBM peak 4.8 TB/s, copy ~4.3 TB/s), and
rel_err = max |pallas - xla| / max |xla|. --sweep instead times the Pallas kernel over a few tile configs per
case and prints the best ones (for block_sizes.py).
"""

from __future__ import annotations

import argparse
import functools
import glob
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gemm.block_sizes import pick_gemm_block
from pallas_kernels.gemm.kernel import matmul

L = 4
SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192), "shared_w1": (2304, 5120)}
MS = (1, 8, 32)
SWEEP = [(32, 256, 4, 3), (64, 256, 4, 3), (64, 512, 4, 3), (128, 256, 8, 3), (64, 128, 4, 4), (128, 128, 4, 4),
         (32, 512, 4, 4), (64, 256, 8, 4)]  # (bn, bk, num_warps, num_stages)


# ----------------------------------------------------------------------------- timing (shared with moe/bench.py)
def wall_us(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def device_us(fn, args, iters: int) -> float | None:
    """Device busy time per call: union of all event intervals on the GPU planes of a profiler trace / iters."""
    jax.block_until_ready(fn(*args))
    try:
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
            spans = [(e.start_ns, e.start_ns + e.duration_ns) for p in pd.planes if p.name.startswith("/device:GPU")
                     for ln in p.lines for e in ln.events if e.duration_ns > 0]
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


def run(cases: list[dict], argv, prog: str, sweep_fn=None):
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--only", default="")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    rows = []
    for c in cases:
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
        from bench.common import write_result
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


# ----------------------------------------------------------------------------- cases
def _make_args(M, N, K, fp8: bool, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
    if fp8:
        w = jax.random.normal(k[1], (L, N, K), jnp.float32).astype(jnp.float8_e4m3fn)
        s = jax.random.randint(k[2], (L, N // 32, K // 32), 115, 125, jnp.int32).astype(jnp.uint8)
        s = jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)
    else:
        w, s = (jax.random.normal(k[1], (L, N, K), jnp.float32) * 0.02).astype(jnp.bfloat16), None
    return jax.block_until_ready((x, w, s, jnp.int32(2)))


def _bytes(M, N, K, fp8: bool) -> int:
    return N * K * (1 if fp8 else 2) + (N // 32) * (K // 32) * fp8 + M * K * 2 + M * N * 4


def _fn(implementation, block=None):
    return jax.jit(lambda x, w, s, l: matmul(x, w, scale=s, layer=l, implementation=implementation, block=block))


def cases() -> list[dict]:
    out = []
    for fp8 in (False, True):
        for wname, (N, K) in SHAPES.items():
            for M in MS:
                out.append({"name": f"gemm_{wname}_{'fp8' if fp8 else 'bf16'}_M{M}", "fn_pallas": _fn("pallas"),
                            "fn_xla": _fn("xla"), "make_args": functools.partial(_make_args, M, N, K, fp8),
                            "bytes": _bytes(M, N, K, fp8), "shape": (M, N, K), "fp8": fp8})
    return out


def sweep_fns(case):
    M, N, K = case["shape"]
    for bn, bk, warps, stages in SWEEP:
        if N % bn or K % bk:
            continue
        blk = pick_gemm_block(M, N, K, fp8=case["fp8"], bn=bn, bk=bk, num_warps=warps, num_stages=stages)
        yield str(blk), _fn("pallas", blk)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    run(cases(), argv, "pallas_kernels.gemm.bench", sweep_fns)


if __name__ == "__main__":
    main()
