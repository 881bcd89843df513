"""The weight GEMMs in the official formats at the full model's shapes, new kernels beside the current ones and XLA.

    python -m bench.weight_gemms --out bench/results/weight_gemms_h200.json [--plot PNG] [--smoke]
        [--sweep-moe M ...] [--sweep-dense M ...] [--only moe|dense] [--iters N]

MoE (384 experts, dim 5120, moe_inter 2304, MXFP4): M = 1, 6, 48, 192, 1536 rows (1 row; then 1, 8, 32, 256
tokens routed top-6 to distinct uniformly random experts), for w1/w3 (the fused `grouped_swiglu`, or two
`grouped_matmul` calls) and w2. FP8 block-32 dense (wq_a, wq_b, wkv, wo_b, the indexer's wq_b, the shared
expert's w1 and w2) and the bf16 LM head, at M = 1, 8, 64 (the head at 1, 8). Block sweeps at the M values of
--sweep-moe / --sweep-dense, the default blocks elsewhere.

Each case is checked against the reference (max |y - ref| / max |ref|) before timing. Timing: each call is
synced, inside one profiler trace; a call's device time is the union of its GPU events (calls are separated
by the sync); the median over `--iters` calls is reported. Inputs rotate so that L2 (60 MB) cannot serve the
weights: MoE calls cycle through 8 routings (different experts), dense calls through a stack of layer copies
(>= 256 MB in all). GB/s counts the packed weight bytes the call must read (active experts' bytes + scales),
against the 4.3 TB/s copy ceiling. Variants fail one by one (the error is recorded, the rest still run).
--smoke: compile every new kernel at small shapes and compare (the GPU compile smoke test), then exit.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gemm import GemmBlock, matmul
from pallas_kernels.gemm.block_sizes import pick_gemm_block
from pallas_kernels.moe import MoeBlock, grouped_matmul, grouped_swiglu, pick_moe_block
from pallas_kernels.moe.kernel import swiglu_rows

E, TOPK, D, INTER = 384, 6, 5120, 2304
MOE_MS = (1, 6, 48, 192, 1536)
DENSE = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
         "idx_wq_b": (4096, 1280), "shared_w13": (2304, 5120), "shared_w2": (5120, 2304)}
HEAD = (129280, 5120)
DENSE_MS = (1, 8, 64)
CEIL = 4300.0
ROUTINGS = 8


# ----------------------------------------------------------------------------- timing
def _gpu_spans(d):
    pd = jax.profiler.ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    return sorted((e.start_ns, e.start_ns + e.duration_ns) for p in pd.planes if p.name.startswith("/device:GPU")
                  for ln in p.lines for e in ln.events if e.duration_ns > 0)


def time_calls(fn, arg_sets, iters: int) -> dict:
    """Median device time per call (us) over `iters` synced calls cycling through arg_sets; wall median too."""
    for a in arg_sets[:2]:
        jax.block_until_ready(fn(*a))
    walls = []
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for i in range(iters):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
                walls.append(time.perf_counter() - t0)
                time.sleep(2e-4)  # a gap between calls on the device timeline
        finally:
            jax.profiler.stop_trace()
        spans = _gpu_spans(d)
    calls, cur = [], None
    for s, e in spans:  # union of intervals, split where the device idled > 50 us (between synced calls)
        if cur is None:
            cur = [s, e, 0.0]
        elif s > cur[1] + 50_000:
            calls.append(cur[2] + cur[1] - cur[0])
            cur = [s, e, 0.0]
        elif s > cur[1]:
            cur[2] += cur[1] - cur[0]
            cur[0], cur[1] = s, e
        else:
            cur[1] = max(cur[1], e)
    if cur is not None:
        calls.append(cur[2] + cur[1] - cur[0])
    per = sorted(c / 1e3 for c in calls)
    wall = statistics.median(walls) * 1e6
    if not per:  # no device plane in the trace (CPU): wall time
        return {"dev_us": wall, "calls_seen": 0, "wall_us": wall}
    med = statistics.median(per) if len(per) == iters else sum(per) / iters
    return {"dev_us": med, "calls_seen": len(per), "wall_us": wall}


def rel_err(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(y)):
        return float("inf")
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _emit(rows, row):
    rows.append(row)
    print("ROW", json.dumps(row), file=sys.stderr, flush=True)  # a run cut short keeps its rows in the log


# ----------------------------------------------------------------------------- inputs
def routing_sizes(M: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if M < TOPK:
        return np.bincount(rng.permutation(E)[:M], minlength=E).astype(np.int32)
    idx = np.stack([rng.permutation(E)[:TOPK] for _ in range(M // TOPK)])
    return np.bincount(idx.reshape(-1), minlength=E).astype(np.int32)


def fp4_weights(key, N, K):
    """Random bytes (every code) and scales 118..125 (|w| up to ~0.2, as the checkpoint's experts)."""
    k1, k2 = jax.random.split(key)
    w = jax.random.randint(k1, (E, N, K // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.randint(k2, (E, N, K // 32), 118, 126, jnp.int32).astype(jnp.uint8)
    return w, jax.lax.bitcast_convert_type(s, jnp.float8_e8m0fnu)


def qdq_rows(key, M, K):
    """Activations as the model feeds the experts: FP8 UE8M0/32-representable bf16."""
    from dsv41_jax import quant

    return quant.fp8_qdq(jax.random.normal(key, (M, K), jnp.float32), 32).astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- MoE
def moe_variants(M: int, N: int, K: int, quick: bool):
    """(name, block) candidates for grouped_matmul on [M rows, N, K]; 'current' = the kernel before this work."""
    cur = pick_moe_block(M, N, K, fp4=True, active=min(M, E))
    out = [("current", MoeBlock(cur.bm, cur.bn, cur.bk, 4, 3, decode="e4m3"))]
    base = pick_moe_block(M, N, K, fp4=True, active=min(M, E))
    out.append(("new-default", base))
    if quick:
        return out
    bm = base.bm
    for bn, bk, w, st, s1 in ((64, 256, 4, 3, False), (64, 256, 4, 4, False), (128, 256, 8, 3, False),
                              (64, 512, 4, 3, False), (32, 256, 4, 4, False), (128, 256, 4, 3, True),
                              (64, 128, 4, 5, False), (64, 256, 8, 4, True)):
        if N % bn or K % bk:
            continue
        blk = pick_moe_block(M, N, K, fp4=True, active=min(M, E), bn=bn, bk=bk, num_warps=w, num_stages=st)
        S = 1 if s1 else blk.splits
        out.append((f"bn{bn}-bk{bk}-w{w}-s{st}-S{S}", MoeBlock(bm, bn, bk, w, st, S)))
    return out


def swiglu_variants(M: int, quick: bool):
    base = pick_moe_block(M, INTER, D, fp4=True, active=min(M, E), fused=True)
    out = [("fused-default", base)]
    if quick:
        return out
    for bn, bk, w, st, S in ((32, 256, 4, 3, 1), (64, 256, 4, 3, 2), (32, 256, 4, 3, 4), (64, 256, 8, 3, 1),
                             (16, 256, 4, 4, 1), (32, 512, 4, 3, 1), (64, 256, 4, 4, 1)):
        out.append((f"fused-bn{bn}-bk{bk}-w{w}-s{st}-S{S}", MoeBlock(base.bm, bn, bk, w, st, S)))
    return out


def bench_moe(args, rows):
    """Weights travel as jit arguments (closing over them would embed GBs of constants in the program)."""
    keys = jax.random.split(jax.random.key(0), 4)
    w1, s1 = fp4_weights(keys[0], INTER, D)
    w3, s3 = fp4_weights(keys[1], INTER, D)
    w2, s2 = fp4_weights(keys[2], D, INTER)
    W = jax.block_until_ready((w1, s1, w3, s3, w2, s2))
    per_expert = INTER * D // 2 + INTER * D // 32  # w1, w3 and w2 alike

    def gm(which, blk=None, impl="pallas"):
        def f(x, g, rw, W):
            w, s = (W[0], W[1]) if which == "w1" else (W[4], W[5])
            return grouped_matmul(x, w, g, scale=s, block=blk, implementation=impl)
        return f

    def sw(blk=None, impl="pallas"):
        def f(x, g, rw, W):
            return grouped_swiglu(x, W[0], W[2], g, rw, scale1=W[1], scale3=W[3], limit=10.0, block=blk,
                                  implementation=impl)
        return f

    def two_calls(blk):  # the current kernel twice + the activation in XLA (the model path before)
        def f(x, g, rw, W):
            g1 = grouped_matmul(x, W[0], g, scale=W[1], block=blk)
            u = grouped_matmul(x, W[2], g, scale=W[3], block=blk)
            return swiglu_rows(g1, u, rw[:, None], 10.0, jnp.bfloat16).astype(jnp.bfloat16)
        return f

    for M in MOE_MS:
        gss = [jnp.asarray(routing_sizes(M, r)) for r in range(ROUTINGS)]
        active = float(np.mean([(np.asarray(g) > 0).sum() for g in gss]))
        x13, x2 = qdq_rows(keys[3], M, D), qdq_rows(keys[3], M, INTER)
        rw = jax.random.uniform(keys[3], (M,), jnp.float32, 0.05, 1.0)
        b1 = active * per_expert
        refs = {"w1": jax.jit(gm("w1", impl="xla"))(x13, gss[0], rw, W),
                "w2": jax.jit(gm("w2", impl="xla"))(x2, gss[0], rw, W),
                "w13+swiglu": jax.jit(sw(impl="xla"))(x13, gss[0], rw, W)}
        quick = M not in args.sweep_moe
        cases = []
        if M in (6, 48):
            cases.append(("w1", "xla", None, gm("w1", impl="xla"), x13, b1))
        for name, blk in moe_variants(M, INTER, D, quick):
            cases.append(("w1", name, blk, gm("w1", blk), x13, b1))
        for name, blk in moe_variants(M, D, INTER, quick):
            cases.append(("w2", name, blk, gm("w2", blk), x2, b1))
        cur13 = [b for n, b in moe_variants(M, INTER, D, True) if n == "current"][0]
        cases.append(("w13+swiglu", "current x2 + xla swiglu", cur13, two_calls(cur13), x13, 2 * b1))
        for name, blk in swiglu_variants(M, quick):
            cases.append(("w13+swiglu", name, blk, sw(blk), x13, 2 * b1))
        for mat, name, blk, f, x, nbytes in cases:
            row = {"kind": "moe", "matrix": mat, "M": M, "variant": name, "block": repr(blk), "bytes": nbytes,
                   "active_experts": active}
            try:
                fj = jax.jit(f)
                row["rel_err"] = rel_err(fj(x, gss[0], rw, W), refs[mat])
                row.update(time_calls(fj, [(x, g, rw, W) for g in gss], 4 if name == "xla" else args.iters))
                row["gbs"] = nbytes / row["dev_us"] / 1e3
            except Exception as exc:  # noqa: BLE001 - a failing variant is recorded, the others still run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                traceback.print_exc()
            _emit(rows, row)
        del refs


# ----------------------------------------------------------------------------- dense
def dense_variants(M, N, K, fp8: bool, quick: bool):
    cur = pick_gemm_block(M, N, K, fp8=fp8)
    out = [("current", GemmBlock(cur.bm, cur.bn, cur.bk, cur.splits, cur.num_warps, cur.num_stages,
                                 decode="convert"))]
    if not fp8:
        return out
    out.append(("new-default", cur))
    if quick:
        return out
    for bn, bk, w, st, sw in ((64, 256, 4, 3, True), (128, 256, 4, 3, True), (64, 512, 4, 3, False),
                              (128, 128, 4, 4, True), (32, 512, 4, 3, False)):
        if N % bn or K % bk:
            continue
        b = pick_gemm_block(M, N, K, fp8=True, bn=bn, bk=bk, num_warps=w, num_stages=st)
        out.append((f"bn{bn}-bk{bk}-w{w}-s{st}-S{b.splits}{'-swap' if sw else ''}",
                    GemmBlock(b.bm, bn, bk, b.splits, w, st, swap=sw)))
    return out


def bench_dense(args, rows):
    from dsv41_jax import quant

    shapes = [(n, nk, True) for n, nk in DENSE.items()] + [("head_bf16", HEAD, False)]
    for name, (N, K), fp8 in shapes:
        nbytes = N * K * (1 if fp8 else 2) + (N // 32) * (K // 32) * fp8
        L = max(2, -(-256 * 2 ** 20 // nbytes))
        k1, k2 = jax.random.split(jax.random.key(1))
        if fp8:
            w = jax.random.normal(k1, (L, N, K), jnp.float32) * 0.02
            q, s = jax.jit(quant.quantize_weight_fp8)(w)
            del w
        else:
            q, s = (jax.random.normal(k1, (L, N, K), jnp.float32) * 0.02).astype(jnp.bfloat16), None
        for M in DENSE_MS if fp8 else (1, 8):
            x = qdq_rows(k2, M, K)
            layers = [jnp.int32(i) for i in range(L)]
            ref = jax.jit(lambda x, l, q, s: matmul(x, q, scale=s, layer=l, implementation="xla"))(x, layers[0], q, s)
            variants = [("xla", None)] + dense_variants(M, N, K, fp8, M not in args.sweep_dense)
            for vname, blk in variants:
                row = {"kind": "dense", "matrix": name, "M": M, "variant": vname, "block": repr(blk),
                       "bytes": nbytes}
                try:
                    impl = "xla" if blk is None else "pallas"
                    fj = jax.jit(lambda x, l, q, s, blk=blk, impl=impl: matmul(x, q, scale=s, layer=l, block=blk,
                                                                             implementation=impl))
                    row["rel_err"] = rel_err(fj(x, layers[0], q, s), ref)
                    row.update(time_calls(fj, [(x, lyr, q, s) for lyr in layers], args.iters))
                    row["gbs"] = nbytes / row["dev_us"] / 1e3
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                    traceback.print_exc()
                _emit(rows, row)


# ----------------------------------------------------------------------------- smoke
def smoke():
    """Compile the new kernels at small shapes on the GPU and compare with their references."""
    from dsv41_jax import quant

    ok = True
    k = jax.random.split(jax.random.key(3), 4)
    e, n, kk = 8, 256, 512
    w = jax.random.normal(k[0], (3, e, n, kk)) * jnp.exp2(jax.random.randint(k[1], (3, e, n, kk // 32, 1), -5, 3)
                                                          ).repeat(32, -1).reshape(3, e, n, kk)
    p, s = quant.quantize_weight_fp4(w)
    gs = jnp.asarray([3, 0, 21, 1, 0, 9, 0, 2], jnp.int32)
    x = qdq_rows(k[2], 40, kk)
    rw = jax.random.uniform(k[3], (40,), jnp.float32, 0.1, 1.0)
    ref = grouped_matmul(x, p, gs, scale=s, layer=1, implementation="xla")
    for blk in (None, MoeBlock(16, 64, 256, splits=2), MoeBlock(16, 32, 128, 8, 4)):
        err = rel_err(grouped_matmul(x, p, gs, scale=s, layer=1, block=blk), ref)
        ok &= err < 1e-5
        print(f"smoke grouped_matmul {blk}: rel_err {err:.2e}", flush=True)
    refh = grouped_swiglu(x, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.0, implementation="xla")
    for blk in (None, MoeBlock(16, 64, 256, splits=2)):
        err = rel_err(grouped_swiglu(x, p[0], p[1], gs, rw, scale1=s[0], scale3=s[1], limit=1.0, block=blk), refh)
        ok &= err < 2 ** -7
        print(f"smoke grouped_swiglu {blk}: rel_err {err:.2e}", flush=True)
    q, sq = quant.quantize_weight_fp8(jax.random.normal(k[0], (2, 256, 512)) * jnp.exp2(
        jax.random.randint(k[1], (2, 8, 1, 16, 1), -6, 4)).repeat(32, 2).repeat(32, 4).reshape(2, 256, 512))
    for M in (1, 5, 40):
        xm = qdq_rows(k[2], M, 512)
        r = matmul(xm, q, scale=sq, layer=1, implementation="xla")
        for blk in (None, GemmBlock(16, 64, 128, 2, swap=True)):
            err = rel_err(matmul(xm, q, scale=sq, layer=1, block=blk), r)
            ok &= err < 1e-5
            print(f"smoke matmul fp8 M={M} {blk}: rel_err {err:.2e}", flush=True)
    print("SMOKE", "OK" if ok else "FAILED", flush=True)
    return ok


# ----------------------------------------------------------------------------- report
def best_rows(rows):
    best = {}
    for r in rows:
        if "error" in r or "gbs" not in r:
            continue
        key = (r["kind"], r["matrix"], r["M"], "xla" if r["variant"] == "xla" else
               ("current" if r["variant"].startswith("current") else "new"))
        if key not in best or r["gbs"] > best[key]["gbs"]:
            best[key] = r
    return best


def table(rows):
    best = best_rows(rows)
    keys = sorted({k[:3] for k in best}, key=lambda k: (k[0], k[1], k[2]))
    lines = [f"{'case':24s} {'M':>5s} {'xla GB/s':>9s} {'cur GB/s':>9s} {'new GB/s':>9s} {'new us':>8s} "
             f"{'%ceil':>5s} {'err':>8s}  best new variant"]
    for k in keys:
        g = {v: best.get((*k, v)) for v in ("xla", "current", "new")}
        f = lambda r: "-" if r is None else f"{r['gbs']:.0f}"  # noqa: E731
        n = g["new"]
        lines.append(f"{k[0] + '/' + k[1]:24s} {k[2]:5d} {f(g['xla']):>9s} {f(g['current']):>9s} {f(n):>9s} "
                     + ("" if n is None else f"{n['dev_us']:8.1f} {100 * n['gbs'] / CEIL:5.0f} "
                        f"{n.get('rel_err', float('nan')):8.1e}  {n['variant']}"))
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_rows(rows)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, kind in zip(axes, ("moe", "dense")):
        keys = sorted({k[:3] for k in best if k[0] == kind}, key=lambda k: (k[1], k[2]))
        labels = [f"{k[1]}\nM={k[2]}" for k in keys]
        xs = np.arange(len(keys))
        for i, v in enumerate(("xla", "current", "new")):
            ax.bar(xs + (i - 1) * 0.27, [best[(*k, v)]["gbs"] if (*k, v) in best else 0 for k in keys], 0.27,
                   label=v)
        ax.axhline(CEIL, color="k", ls="--", lw=1, label="copy ceiling 4.3 TB/s")
        ax.set_xticks(xs, labels, rotation=90, fontsize=6)
        ax.set_ylabel("GB/s of weight bytes")
        ax.set_title("MXFP4 MoE (384 experts)" if kind == "moe" else "FP8 block-32 dense / bf16 head")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.weight_gemms")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default="")
    ap.add_argument("--plot", default="")
    ap.add_argument("--sweep-moe", type=int, nargs="*", default=[6, 48], help="M values that try every block")
    ap.add_argument("--sweep-dense", type=int, nargs="*", default=[8], help="M values that try every block")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--only", default="", help="moe or dense")
    a = ap.parse_args(argv)
    if a.smoke:
        return 0 if smoke() else 1
    rows = []
    if a.only in ("", "moe"):
        bench_moe(a, rows)
    if a.only in ("", "dense"):
        bench_dense(a, rows)
    if a.out:
        from bench.common import write_result

        write_result(a.out, {"rows": rows, "copy_ceiling_gbs": CEIL},
                     "python -m bench.weight_gemms " + " ".join(argv if argv is not None else sys.argv[1:]))
    if a.plot:
        plot(rows, a.plot)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
