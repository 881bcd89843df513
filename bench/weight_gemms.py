"""The weight GEMMs in the official formats at the full model's shapes: every candidate kernel beside the current
ones and XLA, in one run, with the winner per shape printed for the TUNED tables.

    python -m bench.weight_gemms --out bench/results/weight_gemms_h200.json --plot bench/results/weight_gemms_h200.png
        [--budget 270] [--iters 20] [--only moe|dense] [--threads 8] [--ab] [--smoke] [--dry-run]

Groups (bench/weight_gemm_cases.py), in priority order: MXFP4 MoE (384 experts, dim 5120, moe_inter 2304) w1 + w3
+ SwiGLU fused and w2 at M = 6, 48, 1, 192, 1536 rows (top-6 routing of M / 6 tokens to random distinct experts);
FP8 block-32 dense wq_b, wo_b, shared w13 / w2, wq_a, wkv, indexer wq_b at M = 1, 8 (and 64 for the first four);
the bf16 LM head at M = 1. Each group: its cases are compiled in parallel threads, run once and compared with the
XLA reference (max |y - ref| / max |ref|, against each case's tolerance: exact paths 1e-5, FP8 wgmma accumulation
4e-3, bf16 SwiGLU output 1.6e-2), then timed in one profiler trace: `--iters` synced calls per case, cycling
through 8 routings / >= 256 MB of layer copies (L2 cannot serve the weights); a call's device time is the union of
its GPU events; the median is reported. GB/s counts the weight bytes a call must read (active experts' packed
bytes + scales), against the 4.3 TB/s copy ceiling. FP8-dot cases get x as E4M3 codes + scales (what the model's
activation quantization produces), the current kernels bf16 x. A failing case records its error and the run goes
on; `--budget` seconds stops starting new groups (the file and table still come out).
Output: JSON rows (device, date, commit, command), a PNG, the TUNED lines of the winners, a short table last.
--ab: instead of the sweep, each TUNED entry (the model's block) beside its variants and the current kernel:
prefetch on / off, and for the fused w1/w3 MoE kernel the w13 weight schedules (MoeBlock.w13), deeper pipelines
and other K splits (weight_gemm_cases.moe_ab_blocks); w2 with the FP8-dot default with / without prefetch.
--smoke: every kernel family at small shapes against its reference (interpret mode on CPU), then exit.
--dry-run: the whole run (groups, parallel compiles, checks, timing, report) at tiny shapes, for the CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import statistics
import sys
import tempfile
import time
import traceback

import jax
import numpy as np

from bench import weight_gemm_cases as wc

CEIL = 4300.0
CASE_GAP_S, CALL_GAP_S = 0.02, 2e-4  # host sleeps between cases / calls inside one trace
CASE_SPLIT_NS, CALL_SPLIT_NS = 8_000_000, 100_000  # device idle gaps that separate them


# ----------------------------------------------------------------------------- timing
def _gpu_spans(d):
    pd = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    return sorted((e.start_ns, e.start_ns + e.duration_ns) for p in pd.planes if p.name.startswith("/device:GPU")
                  for ln in p.lines for e in ln.events if e.duration_ns > 0)


def _split(spans, gap_ns):
    """Spans (sorted by start) -> groups separated by device idle gaps > gap_ns."""
    out, cur, end = [], [], None
    for s, e in spans:
        if cur and s > end + gap_ns:
            out.append(cur)
            cur, end = [], None
        cur.append((s, e))
        end = e if end is None else max(end, e)
    if cur:
        out.append(cur)
    return out


def _busy_us(spans) -> float:
    busy, s0, e0 = 0.0, None, None
    for s, e in spans:
        if s0 is None:
            s0, e0 = s, e
        elif s > e0:
            busy += e0 - s0
            s0, e0 = s, e
        else:
            e0 = max(e0, e)
    return (busy + (e0 - s0 if s0 is not None else 0)) / 1e3


def time_group(runs) -> list[dict]:
    """runs: [(compiled fn, arg_sets, n_iters)] -> per run {dev_us (median device time per call), wall_us}."""
    walls = [[] for _ in runs]
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for i, (fn, arg_sets, n) in enumerate(runs):
                for it in range(n):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*arg_sets[it % len(arg_sets)]))
                    walls[i].append(time.perf_counter() - t0)
                    time.sleep(CALL_GAP_S)
                time.sleep(CASE_GAP_S)
        finally:
            jax.profiler.stop_trace()
        spans = _gpu_spans(d)
    segs = _split(spans, CASE_SPLIT_NS)
    out = []
    for i, (_, _, n) in enumerate(runs):
        row = {"wall_us": statistics.median(walls[i]) * 1e6}
        if len(segs) == len(runs):
            calls = [_busy_us(c) for c in _split(segs[i], CALL_SPLIT_NS)]
            row["calls_seen"] = len(calls)
            if len(calls) == n:
                row["dev_us"] = statistics.median(calls)
        if "dev_us" not in row:  # no usable device trace (CPU, or the segmentation failed): wall time
            row["dev_us"], row["timing"] = row["wall_us"], "wall"
        out.append(row)
    return out


def rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(y)):
        return float("inf")
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))


# ----------------------------------------------------------------------------- one group
def _compile(case):
    t0 = time.perf_counter()
    c = jax.jit(case.fn).lower(*case.arg_sets[0]).compile()
    return c, time.perf_counter() - t0


def run_group(cases, ref_fn, ref_args, info: dict, a, rows):
    ref = np.asarray(jax.jit(ref_fn)(*ref_args), np.float64)
    with concurrent.futures.ThreadPoolExecutor(max(1, a.threads)) as pool:
        futs = [pool.submit(_compile, c) for c in cases]
        compiled = []
        for case, f in zip(cases, futs):
            try:
                compiled.append(f.result())
            except Exception:  # noqa: BLE001 - retried alone (a thread-safety problem must not lose the case)
                try:
                    compiled.append(_compile(case))
                except Exception as exc:  # noqa: BLE001 - a failing variant is recorded, the others still run
                    compiled.append(exc)
    runs, live = [], []
    for case, comp in zip(cases, compiled):
        row = {"kind": case.kind, "matrix": case.matrix, "M": case.M, "variant": case.variant,
               "block": repr(case.block), "bytes": case.nbytes, "tol": case.tol, **info}
        if case.key is not None:
            row["tuned_key"] = list(case.key)
        if isinstance(comp, Exception):
            row["error"] = f"compile: {type(comp).__name__}: {str(comp)[:400]}"
            rows.append(row)
            continue
        fn, row["compile_s"] = comp[0], round(comp[1], 2)
        try:
            row["rel_err"] = rel_err(fn(*case.arg_sets[0]), ref)
            row["ok"] = case.variant == "xla" or row["rel_err"] <= case.tol
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"run: {type(exc).__name__}: {str(exc)[:400]}"
            traceback.print_exc()
            rows.append(row)
            continue
        runs.append((fn, case.arg_sets, min(a.iters, 4) if case.variant == "xla" and case.kind == "moe" else a.iters))
        live.append(row)
    # the XLA reference gets a trace of its own: a long multi-kernel call must not disturb the others' segmentation
    parts = [[i for i, r in enumerate(live) if r["variant"] == "xla"], [i for i, r in enumerate(live)
                                                                          if r["variant"] != "xla"]]
    for part in parts:
        try:
            for i, t in zip(part, time_group([runs[i] for i in part]) if part else []):
                live[i].update(t)
                live[i]["gbs"] = live[i]["bytes"] / live[i]["dev_us"] / 1e3
        except Exception as exc:  # noqa: BLE001
            for i in part:
                live[i]["error"] = f"timing: {type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
    for row in live:
        rows.append(row)
        print("ROW", json.dumps(row), file=sys.stderr, flush=True)


def groups(a):
    """(label, builder) in priority order (a run out of budget keeps the first ones): MoE at decode sizes, the
    large dense GEMMs at M = 1 / 8, MoE at 1 / 192 / 1536 rows, the small dense ones, M = 64, the head."""
    W, cache = None, {}

    def moe(matrix, M, extra=None):
        def build():
            nonlocal W
            W = W or wc.MoeWeights()
            ex = () if extra is None else extra(M, _active(M))
            return wc.moe_group(W, matrix, M, with_xla=(M == 6 and matrix == "w2" and extra is None), extra=ex,
                                tiled=extra is None)
        return (f"moe {matrix} M={M}", build)

    def dense(matrix, M, extra=None):
        def build():
            if matrix not in cache:
                cache.clear()
                N, K = wc.HEAD if matrix == "head_bf16" else wc.DENSE[matrix]
                cache[matrix] = wc.dense_weights(N, K, fp8=matrix != "head_bf16")
            return wc.dense_group(matrix, M, cache[matrix], extra=() if extra is None else extra(M, *wc.DENSE[matrix]))
        return (f"dense {matrix} M={M}", build)

    if a.ab:
        return ab_groups(moe, dense)
    moe_ms = [M for M in wc.MOE_MS if M in (6, 48)], [M for M in wc.MOE_MS if M not in (6, 48)]
    big = [m for m in wc.DENSE if m in wc.DENSE_M64]
    small = [m for m in wc.DENSE if m not in wc.DENSE_M64]
    low, high = [M for M in wc.DENSE_MS if M < 64], [M for M in wc.DENSE_MS if M >= 64]
    out = []
    if a.only in ("", "moe"):
        out += [moe(mat, M) for M in moe_ms[0] for mat in ("w13+swiglu", "w2")]
    if a.only in ("", "dense"):
        out += [dense(mat, M) for mat in big for M in low]
    if a.only in ("", "moe"):
        out += [moe(mat, M) for M in moe_ms[1] for mat in ("w13+swiglu", "w2")]
    if a.only in ("", "dense"):
        out += [dense(mat, M) for mat in small for M in low] + [dense(mat, M) for mat in big for M in high]
        out.append(dense("head_bf16", 1))
    return out


def _active(M: int) -> float:
    """Mean active experts over the bench's routings of M rows (what moe_group measures)."""
    return float(np.mean([(wc.routing_sizes(M, r) > 0).sum() for r in range(wc.ROUTINGS)]))


def ab_groups(moe, dense):
    """--ab: each TUNED entry (the model's block) beside its variants (prefetch toggled; for the fused w1/w3 MoE
    kernel the w13 weight schedules, pipeline depths and K splits of weight_gemm_cases.moe_ab_blocks), and the current
    kernel; then w2 with the FP8-dot default with / without prefetch."""
    from pallas_kernels.gemm.block_sizes import TUNED as DENSE_TUNED
    from pallas_kernels.moe.block_sizes import TUNED as MOE_TUNED

    names = {v: k for k, v in wc.DENSE.items()}
    out = [moe("w13+swiglu", M, wc.moe_ab_blocks) for M in (6, 48, 1, 192)
           if ("swiglu", wc.INTER, wc.D, M) in MOE_TUNED]
    out += [dense(names[(N, K)], M, wc.dense_ab_blocks) for (N, K, M) in DENSE_TUNED if (N, K) in names]
    return out + [moe("w2", M, wc.w2_ab_blocks) for M in (6, 48)]


# ----------------------------------------------------------------------------- report
def best(rows, pred):
    r = [x for x in rows if x.get("ok") and "gbs" in x and pred(x)]
    return max(r, key=lambda x: x["gbs"]) if r else None


def winners(rows) -> list[dict]:
    """Per (kind, matrix, M): the fastest correct case, with the TUNED line to paste."""
    out = []
    for k in sorted({(r["kind"], r["matrix"], r["M"]) for r in rows}):
        w = best(rows, lambda x, k=k: (x["kind"], x["matrix"], x["M"]) == k and x["variant"] != "xla")
        if w is None:
            continue
        if w["variant"] == "current" or "tuned_key" not in w:
            line = None
        else:
            table = "pallas_kernels/moe/block_sizes.py" if k[0] == "moe" else "pallas_kernels/gemm/block_sizes.py"
            note = " (reads MXFP4_LAYOUT = 'tiled' weights)" if "layout='tiled'" in w["block"] else ""
            line = f"TUNED[{tuple(w['tuned_key'])!r}] = {w['block']}  # {table}{note}"
        out.append({"kind": k[0], "matrix": k[1], "M": k[2], "variant": w["variant"], "gbs": w["gbs"], "line": line})
    return out


def table(rows) -> str:
    keys = sorted({(r["kind"], r["matrix"], r["M"]) for r in rows})
    lines = [f"{'case':22s} {'M':>5s} {'xla':>6s} {'cur':>6s} {'best':>6s} {'us':>8s} {'%ceil':>5s} {'err':>8s}  "
             "best variant (GB/s)"]
    for k in keys:
        sel = lambda v, k=k: best(rows, lambda x: (x["kind"], x["matrix"], x["M"]) == k and v(x["variant"]))  # noqa
        x, c, n = sel(lambda v: v == "xla"), sel(lambda v: v == "current"), sel(lambda v: v != "xla")
        g = lambda r: "-" if r is None else f"{r['gbs']:.0f}"  # noqa: E731
        lines.append(f"{k[0] + ' ' + k[1]:22s} {k[2]:5d} {g(x):>6s} {g(c):>6s} {g(n):>6s} "
                     + ("" if n is None else f"{n['dev_us']:8.1f} {100 * n['gbs'] / CEIL:5.0f} "
                        f"{n.get('rel_err', float('nan')):8.1e}  {n['variant']}"))
    bad = [r for r in rows if "error" in r or not r.get("ok", True)]
    lines.append(f"{len(rows)} cases, {len(bad)} failed or out of tolerance")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    for ax, kind in zip(axes, ("moe", "dense")):
        keys = sorted({(r["matrix"], r["M"]) for r in rows if r["kind"] == kind})
        xs = np.arange(len(keys))
        for i, (label, pred) in enumerate((("xla", lambda v: v == "xla"), ("current", lambda v: v == "current"),
                                           ("best new", lambda v: v not in ("xla", "current")))):
            vals = []
            for k in keys:
                b = best(rows, lambda x, k=k, p=pred: x["kind"] == kind and (x["matrix"], x["M"]) == k
                         and p(x["variant"]))
                vals.append(0 if b is None else b["gbs"])
            ax.bar(xs + (i - 1) * 0.27, vals, 0.27, label=label)
        ax.axhline(CEIL, color="k", ls="--", lw=1, label="copy ceiling 4.3 TB/s")
        ax.set_xticks(xs, [f"{m}\nM={n}" for m, n in keys], rotation=90, fontsize=6)
        ax.set_ylabel("GB/s of weight bytes")
        ax.set_title("MXFP4 MoE (384 experts)" if kind == "moe" else "FP8 block-32 dense / bf16 head")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ----------------------------------------------------------------------------- smoke
def smoke() -> bool:
    """Each kernel family at small shapes against its reference (interpret mode on CPU, compiled on a GPU)."""
    from dsv41_jax import quant
    from pallas_kernels.gemm import GemmBlock, matmul
    from pallas_kernels.moe import MoeBlock, grouped_matmul, grouped_swiglu

    ok = True
    k = jax.random.split(jax.random.key(3), 4)
    e, n, kk = 8, 128, 512
    w = jax.random.normal(k[0], (2, e, n, kk)) * jax.numpy.exp2(
        jax.random.randint(k[1], (2, e, n, kk // 32, 1), -5, 3)).repeat(32, -1).reshape(2, e, n, kk)
    p, s = quant.quantize_weight_fp4(w)
    gs = jax.numpy.asarray([3, 0, 21, 1, 0, 9, 0, 2], jax.numpy.int32)
    xb, xq, xc = wc.fp8_rows(k[2], 40, kk)
    rw = jax.random.uniform(k[3], (40,), jax.numpy.float32, 0.1, 1.0)
    ref = grouped_matmul(xb, p, gs, scale=s, layer=1, implementation="xla")
    for blk in (None, MoeBlock(16, 64, 256, splits=2), MoeBlock(2, 64, 256, nb=8, decode="fp8", swap=True),
                MoeBlock(2, 64, 256, 4, 3, 2, decode="fp8", nb=8, swap=True, fast_accum=True),
                MoeBlock(4, 32, 128, decode="fp8", nb=4)):
        fp8 = blk is not None and blk.decode == "fp8"
        y = grouped_matmul(xq if fp8 else xb, p, gs, scale=s, layer=1, block=blk, x_scale=xc if fp8 else None)
        err, tol = rel_err(y, ref), (wc.TOL_FAST if blk is not None and blk.fast_accum else wc.TOL_EXACT)
        ok &= err <= tol
        print(f"smoke grouped_matmul {blk}: rel_err {err:.2e} (tol {tol})", flush=True)
    refh = grouped_swiglu(xb, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.0, implementation="xla")
    for blk in (None, MoeBlock(2, 64, 256, nb=8, decode="fp8", swap=True, fast_accum=True, splits=2)):
        fp8 = blk is not None
        h = grouped_swiglu(xq if fp8 else xb, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.0, block=blk,
                           x_scale=xc if fp8 else None)
        err = rel_err(h, refh)
        ok &= err <= wc.TOL_BF16_OUT
        print(f"smoke grouped_swiglu {blk}: rel_err {err:.2e}", flush=True)
    q, sq = quant.quantize_weight_fp8(jax.random.normal(k[0], (2, 256, 512)) * jax.numpy.exp2(
        jax.random.randint(k[1], (2, 8, 1, 16, 1), -6, 4)).repeat(32, 2).repeat(32, 4).reshape(2, 256, 512))
    fp8_blocks = {1: [GemmBlock(1, 64, 512, decode="fp8", nb=16, swap=True, fast_accum=True),
                      GemmBlock(2, 32, 256, 2, decode="fp8", nb=8)],
                  5: [GemmBlock(8, 64, 256, decode="fp8", nb=2, swap=True, fast_accum=True),
                      GemmBlock(8, 32, 64, 2, decode="fp8", nb=2)],
                  40: [GemmBlock(64, 64, 128, decode="fp8", nb=1, fast_accum=True),
                       GemmBlock(64, 64, 64, 2, 4, 3, decode="fp8", nb=1, swap=True)]}
    for M, fp8_blks in fp8_blocks.items():
        xb, xq, xc = wc.fp8_rows(k[2], M, 512)
        r = matmul(xb, q, scale=sq, layer=1, implementation="xla")
        for blk in [None, GemmBlock(16, 64, 128, 2, swap=True), *fp8_blks]:
            fp8 = blk is not None and blk.decode == "fp8"
            y = matmul(xq if fp8 else xb, q, scale=sq, layer=1, block=blk, x_scale=xc if fp8 else None)
            err, tol = rel_err(y, r), (wc.TOL_FAST if blk is not None and blk.fast_accum else wc.TOL_EXACT)
            ok &= err <= tol
            print(f"smoke matmul M={M} {blk}: rel_err {err:.2e} (tol {tol})", flush=True)
    print("SMOKE", "OK" if ok else "FAILED", flush=True)
    return bool(ok)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.weight_gemms")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--only", default="", help="moe or dense")
    ap.add_argument("--budget", type=float, default=270.0, help="start no new group after this many seconds")
    ap.add_argument("--threads", type=int, default=8, help="parallel compiles per group")
    ap.add_argument("--ab", action="store_true", help="the TUNED entries beside their variants (ab_groups)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="the whole run at tiny shapes (CPU check of the script)")
    a = ap.parse_args(argv)
    if a.smoke:
        return 0 if smoke() else 1
    if a.dry_run:
        wc.E, wc.D, wc.INTER, wc.HEAD, wc.MOE_MS, wc.DENSE_MS = 16, 512, 256, (512, 256), (6, 48), (1, 64)
        wc.DENSE = {"wq_b": (256, 128), "wkv": (64, 512)}
        wc.DENSE_M64 = ("wq_b",)
    t0 = time.perf_counter()
    rows, skipped = [], []
    for label, build in groups(a):
        if time.perf_counter() - t0 > a.budget:
            skipped.append(label)
            continue
        tg = time.perf_counter()
        try:
            cases, ref_fn, ref_args, info = build()
            run_group(cases, ref_fn, ref_args, info, a, rows)
        except Exception as exc:  # noqa: BLE001 - a group that cannot even be built is recorded
            rows.append({"kind": label.split()[0], "matrix": label.split()[1], "M": int(label.split("=")[-1]),
                         "variant": "group", "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            traceback.print_exc()
        print(f"group {label}: {time.perf_counter() - tg:.1f} s", file=sys.stderr, flush=True)
    win = winners(rows)
    result = {"rows": rows, "winners": win, "copy_ceiling_gbs": CEIL, "skipped_groups": skipped,
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    if a.out:
        from bench.common import write_result

        write_result(a.out, result, "python -m bench.weight_gemms " + " ".join(argv if argv is not None else
                                                                                sys.argv[1:]))
    if a.plot:
        try:
            plot(rows, a.plot)
        except ImportError as exc:  # matplotlib is in the GPU image, not in every environment
            print(f"# no plot: {exc}")
    print("# winners (paste into the TUNED tables):")
    for w in win:
        print(w["line"] or f"# {w['kind']} {w['matrix']} M={w['M']}: current kernel wins ({w['gbs']:.0f} GB/s)")
    if skipped:
        print(f"# out of budget, not run: {skipped}")
    print(table(rows))
    print(f"elapsed {result['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
