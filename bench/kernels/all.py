"""Per-kernel microbenchmarks at the full model's shapes, every Pallas kernel beside its XLA reference.

    python -m bench.kernels --out bench/results/kernels_h200.json [--only SUBSTR] [--iters 30] [--smoke]

(`python -m bench.kernels.all` is the same.)

Cases come from each kernel's `cases(smoke)` (bench/kernels/{gemm,moe,indexer,sparse_attention,mhc,mega_mhc,
mega_gate,ring_write}.py; --smoke: their tiny shapes, for a CPU run in interpret mode):
dicts with name, fn_pallas, fn_xla, make_args (random full-shape device arrays, fixed seed) and bytes (the
fewest bytes the op must move). For each case: both outputs are compared (max |diff| / max |ref| over the
finite entries; masked -inf entries must agree exactly), then both are timed as device busy time per call
from a profiler trace (wall time of synced calls when no trace is available), and the achieved bandwidth is
bytes / Pallas time, against the ~4.3 TB/s copy ceiling measured on the H200. Prints a short table last.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

import jax
import numpy as np

from bench.common import write_result
from bench.kernels.timing import device_us, wall_us

PACKAGES = ("gemm", "moe", "indexer", "sparse_attention", "mhc", "mega_mhc", "mega_gate", "ring_write")
COPY_CEILING_GBS = 4300.0


def compare(got, want) -> tuple[float, bool]:
    """(max |got - want| / max |want| over entries finite in both, masks equal: non-finite where want is)."""
    g = np.asarray(jax.device_get(got), np.float64)
    w = np.asarray(jax.device_get(want), np.float64)
    fin = np.isfinite(w)
    masks_equal = bool(np.array_equal(np.isfinite(g), fin) and np.array_equal(g[~fin], w[~fin]))
    if not fin.any():
        return 0.0, masks_equal
    err = np.max(np.abs(g[fin] - w[fin])) / max(np.max(np.abs(w[fin])), 1e-30)
    return float(err), masks_equal


def collect(only: str, smoke: bool = False):
    cases = []
    for pkg in PACKAGES:
        try:
            mod = importlib.import_module(f"bench.kernels.{pkg}")
        except ModuleNotFoundError:
            print(f"(no bench module for {pkg})", file=sys.stderr)
            continue
        for c in mod.cases(smoke):
            c = dict(c, name=f"{pkg}/{c['name']}")
            if only in c["name"]:
                cases.append(c)
    return cases


def leaves(x):
    return [v for v in jax.tree.leaves(x)]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.kernels")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="every kernel's tiny cases (CPU: interpret mode)")
    a = ap.parse_args(argv)
    rows = []
    for c in collect(a.only, a.smoke):
        row = {"name": c["name"], "bytes": c["bytes"]}
        try:
            args = c["make_args"]()
            yp, yx = c["fn_pallas"](*args), c["fn_xla"](*args)
            errs = [compare(p, x) for p, x in zip(leaves(yp), leaves(yx))]
            row["rel_err"] = max(e for e, _ in errs)
            row["masks_equal"] = all(m for _, m in errs)
            del yp, yx
            for k in ("pallas", "xla"):
                dev = device_us(c[f"fn_{k}"], args, a.iters)
                row[f"{k}_dev_us"] = dev
                row[f"{k}_wall_us"] = wall_us(c[f"fn_{k}"], args, a.iters)
            del args
        except Exception as exc:  # noqa: BLE001 - one failing case is reported, the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    if a.out:
        write_result(a.out, {"rows": rows, "copy_ceiling_gbs": COPY_CEILING_GBS},
                     "python -m bench.kernels " + " ".join(argv if argv is not None else sys.argv[1:]))
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print(f"{'case':34s} {'pallas us':>9s} {'xla us':>9s} {'speedup':>7s} {'GB/s':>6s} {'%ceil':>5s} {'rel_err':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:34s} ERROR {r['error'][:80]}")
            continue
        pt = r["pallas_dev_us"] or r["pallas_wall_us"]
        xt = r["xla_dev_us"] or r["xla_wall_us"]
        gbs = r["bytes"] / pt / 1e3
        print(f"{r['name']:34s} {f(pt):>9s} {f(xt):>9s} {xt / pt:7.2f} {gbs:6.0f} {100 * gbs / COPY_CEILING_GBS:5.0f} "
              f"{r['rel_err']:8.1e}" + ("" if r["masks_equal"] else " MASKS-DIFFER"))
    return rows


if __name__ == "__main__":
    main()
