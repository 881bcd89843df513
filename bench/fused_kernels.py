"""The fused decode kernels against the unfused paths they replace, at the full model's shapes, in one run.

    python -m bench.fused_kernels --out FILE.json    (H200: about 3 minutes; the result of record: fused_kernels_h200)
    python -m bench.fused_kernels --smoke                                         (CPU, interpret mode: tiny shapes)

Ops (cases from bench/kernels/<op>.py `variants()`): mega_mhc (one mHC sublayer boundary, D = 5120; unfused sides:
"xla" = the model's XLA path, "prev_pallas" = the composition --kernels pallas ran before: XLA glue around the
Sinkhorn kernel), mega_gate (the router, D = 5120, E = 384 (full) and 16 (medium), top-6; unfused: "xla") and
ring_write (the FP8 SWA ring write of decode rows into a 40-layer pool, d = 512; unfused: "xla", SwaPool.write)
and sparse_attention (the paged attention kernel with its in-kernel split merge and inverse RoPE, full decode
shape; unfused: "xla", the model's path), at N = 1, 8, 32, 256 rows (attention: 1, 8, 32; the medium router's
16 experts: 1, 8, last).

For every (op, N): numerics first (each fused implementation against the reference: max |diff| / max |ref| per
float output, the fraction of differing integer outputs), then every implementation timed three ways:
- loop_us: the median over `--reps` runs of one jitted program calling the implementation `--loop` times in a
  fori_loop, each call on another layer of the stacked weights (what a decode step does: launch gaps included,
  host dispatch excluded), divided by `--loop`;
- dev_us: device busy time per call from a profiler trace (kernels only; XLA turns command buffers off while
  tracing), for the fused implementations and the "xla" side;
- wall_us: the median wall time of one synced call (host dispatch included).
speedup = the unfused loop_us / the fused loop_us. A failing case prints an error row and the run continues;
`--budget` seconds stops starting new cases (they are reported as skipped). Writes the JSON (bench.common's
device / date / commit / command) and a PNG of the speedups beside it (when matplotlib is installed), and prints a
short table last.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_result
from bench.kernels.timing import device_us, wall_us

OPS = ("mega_mhc", "mega_gate", "ring_write", "sparse_attention")


def compare(got, want) -> dict:
    """max |got - want| / max |want| over the float leaves; the fraction of differing integer elements."""
    err, mism = 0.0, 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(jax.device_get(g)), np.asarray(jax.device_get(w))
        if g.shape != w.shape:
            raise ValueError(f"shape {g.shape} != reference {w.shape}")
        if np.issubdtype(w.dtype, np.integer):
            mism = max(mism, float(np.mean(g != w)))
            continue
        g, w = g.astype(np.float64), w.astype(np.float64)
        if not np.isfinite(g).all():
            raise ValueError("non-finite output")
        err = max(err, float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)))
    return {"rel_err": err, "int_mismatch": mism}


def looped(fn, n_layers: int, loop: int, carry: int | None = None):
    """One program calling fn `loop` times, call i on layer i % n_layers (the last argument), outputs kept alive;
    with `carry`, that argument is the loop's carry and each call's output replaces it (state updated in place)."""

    @jax.jit
    def run(*args):
        def call(i, a):
            return fn(*a[:-1], (a[-1] + i) % n_layers)

        if carry is not None:
            def body(i, c):
                return call(i, args[:carry] + (c,) + args[carry + 1:])

            return jnp.sum(jax.lax.fori_loop(0, loop, body, args[carry]).reshape(-1)[:1].astype(jnp.float32))

        def body(i, acc):
            leaf = jax.tree.leaves(call(i, args))[0]
            return acc + leaf.reshape(-1)[0].astype(jnp.float32)

        return jax.lax.fori_loop(0, loop, body, jnp.zeros((), jnp.float32))

    return run


def loop_us(fn, args, n_layers, loop, reps, carry=None) -> float:
    run = looped(fn, n_layers, loop, carry)
    jax.block_until_ready(run(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6 / loop


def run_case(v, a, t_end) -> list[dict]:
    rows = []
    base = {"op": v["op"], "n": v["n"], "bytes": v["bytes"]}
    if time.perf_counter() > t_end:
        return [dict(base, impl=k, error="skipped: budget") for k in (*v["fused"], *v["unfused"])]
    try:
        args = v["make_args"]()
        want = v["reference"](*args)
    except Exception as exc:  # noqa: BLE001 - report and go on
        traceback.print_exc()
        return [dict(base, impl="reference", error=f"{type(exc).__name__}: {str(exc)[:300]}")]
    n_layers = v["n_layers"]
    for kind, impls in (("fused", v["fused"]), ("unfused", v["unfused"])):
        for name, fn in impls.items():
            row = dict(base, impl=name, kind=kind)
            try:
                if kind == "fused":
                    row.update(compare(fn(*args), want))
                row["loop_us"] = loop_us(fn, args, n_layers, a.loop, a.reps, v.get("carry"))
                row["wall_us"] = wall_us(fn, args, a.iters)
                if not a.no_trace and (kind == "fused" or name == "xla"):
                    row["dev_us"] = device_us(fn, args, a.iters)
            except Exception as exc:  # noqa: BLE001 - one failing implementation is an error row
                traceback.print_exc()
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    fused = [r for r in rows if r.get("kind") == "fused" and "loop_us" in r]
    for r in rows:
        if r.get("kind") == "unfused" and "loop_us" in r:
            for f in fused:
                f[f"speedup_vs_{r['impl']}"] = round(r["loop_us"] / f["loop_us"], 3)
    return rows


def plot(rows, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        sub = [r for r in rows if r["op"] == op and r.get("kind") == "fused"]
        keys = sorted({k for r in sub for k in r if k.startswith("speedup_vs_")})
        ns = sorted({r["n"] for r in sub})
        impls = sorted({r["impl"] for r in sub})
        width = 0.8 / max(len(keys) * len(impls), 1)
        j = 0
        for impl in impls:
            for k in keys:
                vals = [next((r.get(k, 0) for r in sub if r["n"] == n and r["impl"] == impl), 0) for n in ns]
                ax.bar(np.arange(len(ns)) + j * width, vals, width, label=f"{impl} {k.replace('speedup_', '')}")
                j += 1
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xticks=np.arange(len(ns)) + 0.4 - width / 2, xticklabels=[str(n) for n in ns], xlabel="rows (batch)",
               ylabel="speedup (unfused / fused, in-program loop)", title=op)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.fused_kernels")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: interpret mode)")
    ap.add_argument("--only", default="", help="substring of the op name")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--loop", type=int, default=40, help="calls per timed program (loop_us)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-trace", action="store_true", help="skip the profiler (dev_us)")
    ap.add_argument("--budget", type=float, default=215.0, help="seconds after which no new case starts")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.smoke:
        a.iters, a.loop, a.reps = min(a.iters, 2), min(a.loop, 2), min(a.reps, 1)
    t_end = time.perf_counter() + a.budget
    rows, todo = [], []
    for op in OPS:
        if a.only not in op:
            continue
        try:
            todo += importlib.import_module(f"bench.kernels.{op}").variants(a.smoke)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"op": op, "n": 0, "impl": "-", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    for v in sorted(todo, key=lambda v: v.get("priority", 0)):  # stable: each op's own order within a priority
        rows.extend(run_case(v, a, t_end))
    cmd = "python -m bench.fused_kernels " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.out:
        write_result(a.out, {"rows": rows, "loop": a.loop, "reps": a.reps, "iters": a.iters}, cmd)
        png = plot(rows, a.out.rsplit(".", 1)[0] + ".png")
        print(f"wrote {a.out}" + (f" and {png}" if png else " (no matplotlib: no PNG)"))
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"{'op':16s} {'N':>4s} {'impl':14s} {'loop_us':>8s} {'dev_us':>8s} {'wall_us':>8s} {'rel_err':>8s} speedups")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:16s} {r['n']:4d} {r['impl']:14s} ERROR {r['error'][:90]}")
            continue
        sp = " ".join(f"{k[11:]}={v:.2f}" for k, v in r.items() if k.startswith("speedup_vs_"))
        err = f"{r['rel_err']:8.1e}" if "rel_err" in r else f"{'ref':>8s}"
        mism = f" idx_mismatch={r['int_mismatch']:.3f}" if r.get("int_mismatch") else ""
        print(f"{r['op']:16s} {r['n']:4d} {r['impl']:14s} {f(r.get('loop_us')):>8s} {f(r.get('dev_us')):>8s} "
              f"{f(r.get('wall_us')):>8s} {err} {sp}{mism}")
    return rows


if __name__ == "__main__":
    main()
