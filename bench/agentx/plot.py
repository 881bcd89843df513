"""Pareto plot of an AgentX sweep: throughput per GPU (TPGS) against interactivity, one line per side.

    python -m bench.agentx.plot bench/results/agentx_h200_*_c*.json --out bench/results/agentx_h200_pareto.png

Left: the North-Star plane, TPGS against E2E-normalised interactivity p90 (1 / p90 of E2EL / OSL); right:
TPGS against interactivity p90 (1 / p90 ITL). Each point is one concurrency (labelled N), the non-dominated
points of each side (higher is better on both axes) are ringed, and the dashed line marks the 50 tok/s/user
SLO the seed articles quote. matplotlib is needed (the `bench` extra); `plot_pareto` returns None without it.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench.agentx.metrics import SLO, slo_targets
from bench.agentx.sides import DAY0, server_flags

COLORS = {"day0": "#999999", "day0-eager": "#cccccc", "exact": "#d08a2c", "optimised": "#2a7ab0"}


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated by another (maximising both coordinates)."""
    keep = []
    for i, (x, y) in enumerate(points):
        if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i):
            keep.append(i)
    return keep


def plot_pareto(rows: list[dict], path, title: str = "AgentX-style sweep") -> str | None:
    """rows: {side, concurrency, tpgs, e2e_norm_intvty_p90, intvty_p90}; writes a PNG, returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("e2e_norm_intvty_p90", "E2E-normalised interactivity p90 (tok/s/user)"),
              ("intvty_p90", "interactivity p90 = 1 / p90 ITL (tok/s/user)"))
    for ax, (xkey, xlabel) in zip(axes, panels):
        for side in sorted({r["side"] for r in rows}):
            pts = sorted((r for r in rows if r["side"] == side and r.get(xkey) and r.get("tpgs")),
                         key=lambda r: r["concurrency"])
            if not pts:  # the side ran but finished no request in its window: say so on the chart
                ns = ",".join(str(r["concurrency"]) for r in rows if r["side"] == side)
                ax.plot([], [], "o", color=COLORS.get(side), label=f"{side}: no request completed (N={ns})")
                continue
            xs, ys = [r[xkey] for r in pts], [r["tpgs"] for r in pts]
            color = COLORS.get(side)
            ax.plot(xs, ys, "o-", color=color, label=side)
            for r, x, y in zip(pts, xs, ys):
                ax.annotate(f"N={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            for i in pareto_front(list(zip(xs, ys))):
                ax.plot(xs[i], ys[i], "o", ms=12, mfc="none", mec=color or "k")
        ax.axvline(SLO, ls="--", color="#c33", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("TPGS (total tokens / GPU / s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def rows_from_files(paths) -> list[dict]:
    rows = []
    for p in paths:
        rec = json.load(open(p))
        res = rec.get("result", rec)
        if "headline" in res:
            rows.append(dict(res["headline"], side=res["side"], concurrency=res["concurrency"]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="per-run JSON files written by python -m bench.agentx")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="AgentX-style sweep")
    ap.add_argument("--summary", default=None,
                    help="also write a summary JSON of these points (rows, the best TPGS at >= 50 tok/s/user)")
    a = ap.parse_args(argv)
    rows = rows_from_files(a.files)
    print(plot_pareto(rows, a.out, a.title) or "matplotlib is not installed")
    if a.summary:
        from bench.common import write_result

        write_result(a.summary, {"rows": rows, "files": list(a.files), "slo_50": slo_targets(rows),
                                 "day0_flags": server_flags(DAY0), "png": a.out},
                     "python -m bench.agentx.plot " + " ".join(argv if argv is not None else sys.argv[1:]),
                     source=_source(a.files))
        print(a.summary)


def _source(paths) -> dict:
    """device / jax / commit of the runs a summary is made from (the latest file's), not of this process."""
    recs = [json.load(open(p)) for p in paths]
    recs = [r for r in recs if "device" in r]
    if not recs:
        return {}
    last = max(recs, key=lambda r: r.get("date", ""))
    return {k: last.get(k) for k in ("device", "jax", "date", "commit")}


if __name__ == "__main__":
    main()
