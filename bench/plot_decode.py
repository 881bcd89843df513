"""Plot decode ITL against batch and against context (Pallas vs XLA vs the roofline) from bench/decode_itl.py results.

    python -m bench.plot_decode [--out docs/img/h200_decode_itl.png] [FILES...]
"""

from __future__ import annotations

import argparse
import json

DEFAULT = ["bench/results/decode_medium_bf16_h200.json", "bench/results/decode_medium_fp8_h200.json"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.plot_decode")
    ap.add_argument("files", nargs="*", default=DEFAULT)
    ap.add_argument("--out", default="docs/img/h200_decode_itl.png")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for f in a.files for r in json.load(open(f))["result"]["rows"]]
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


if __name__ == "__main__":
    main()
