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
    a = ap.parse_args(argv)
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
