"""Plot decode ITL against batch and against context (Pallas vs XLA vs the roofline) from bench/decode_itl.py results.

    python -m bench.plot_decode [--out docs/img/h200_decode_itl.png] [FILES...]
    python -m bench.plot_decode --scheduling --out docs/img/h200_async_scheduling.png FILES...   # async vs sync bars
"""

from __future__ import annotations

import argparse
import json

DEFAULT = ["bench/results/decode_medium_bf16_h200.json", "bench/results/decode_medium_fp8_h200.json"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.plot_decode")
    ap.add_argument("files", nargs="*", default=DEFAULT)
    ap.add_argument("--out", default="docs/img/h200_decode_itl.png")
    ap.add_argument("--scheduling", action="store_true",
                    help="bars: ITL with async scheduling and with collect-first steps, per format and batch")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for f in a.files for r in json.load(open(f))["result"]["rows"]]
    if a.scheduling:
        return plot_scheduling(rows, a.out, plt)
    fmts = sorted({r["weight_format"] for r in rows})
    fig, axes = plt.subplots(len(fmts), 2, figsize=(11, 4 * len(fmts)), squeeze=False)
    for i, fmt in enumerate(fmts):
        sub = [r for r in rows if r["weight_format"] == fmt]
        ax = axes[i][0]
        ctx = max(r["context"] for r in sub)
        for k, style in (("pallas", "o-"), ("xla", "s--")):
            pts = sorted((r["batch"], r["itl_ms"]) for r in sub if r["kernels"] == k and r["context"] == ctx)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{k}")
        roof = sorted({(r["batch"], r["roofline_ms"]) for r in sub if r["context"] == ctx})
        ax.plot(*zip(*roof), "k:", label="HBM roofline")
        ax.set(xscale="log", xlabel="batch", ylabel="ITL (ms)", title=f"medium {fmt}: ITL vs batch ({ctx} context)")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax = axes[i][1]
        for (k, b), style in zip([(k, b) for k in ("pallas", "xla") for b in sorted({r["batch"] for r in sub})],
                                 ["o-", "o-", "o-", "s--", "s--", "s--"]):
            pts = sorted((r["context"], r["itl_ms"]) for r in sub if r["kernels"] == k and r["batch"] == b)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{k} B={b}")
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="ITL (ms)", title=f"medium {fmt}: ITL vs context")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)


def plot_scheduling(rows, out, plt):
    """One bar pair (sync, async) per (weight format, batch) at the smallest context, the roofline as a tick."""
    ctx = min(r["context"] for r in rows)
    keys = sorted({(r["weight_format"], r["batch"]) for r in rows if r["context"] == ctx and "scheduling" in r})
    fig, ax = plt.subplots(figsize=(1.4 * len(keys) + 2, 4))
    for j, sched in enumerate(("sync", "async")):
        vals = [next((r["itl_ms"] for r in rows if (r["weight_format"], r["batch"]) == k and r["context"] == ctx
                      and r.get("scheduling") == sched), 0) for k in keys]
        xs = [i + (j - 0.5) * 0.38 for i in range(len(keys))]
        ax.bar(xs, vals, 0.38, label="collect first (sync)" if sched == "sync" else "async scheduling")
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    roof = [next(r["roofline_ms"] for r in rows if (r["weight_format"], r["batch"]) == k) for k in keys]
    ax.scatter(range(len(keys)), roof, marker="_", s=900, color="k", label="HBM roofline", zorder=3)
    ax.set_xticks(range(len(keys)), [f"{f}\nB={b}" for f, b in keys])
    ax.set(ylabel="ITL (ms)", title=f"medium decode ITL, --kernels auto, context {ctx}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
