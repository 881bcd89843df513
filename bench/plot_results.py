"""Plot the H200 results (TTFT cold vs warm turn, CED vs plain prefill) from bench/results/*.json.

    python -m bench.plot_results   # -> docs/img/h200_prefill.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

R = Path(__file__).parent / "results"


def main():
    eng = json.loads((R / "engine_medium_h200.json").read_text())["result"]
    ced = json.loads((R / "ced_prefill_medium_h200.json").read_text())["result"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    ax[0].bar(["plain\n(decoder on 8192 rows)", "CED\n(decoder on 128 rows)"],
              [ced["full_median_s"], ced["ced_median_s"]], color=["#999", "#3a7"])
    ax[0].set_ylabel("seconds")
    ax[0].set_title(f"prefill of {ced['tokens']} tokens (medium, H200)")
    ax[1].bar([f"cold turn\n({eng['prompt_len']} tokens)", f"warm turn\n(+{eng['new_tokens']} tokens, replay 128)"],
              [eng["cold_ttft_median_s"], eng["warm_ttft_median_s"]], color=["#999", "#37a"])
    ax[1].set_title("engine TTFT (medium, H200)")
    for a in ax:
        for p in a.patches:
            a.annotate(f"{p.get_height():.2f} s", (p.get_x() + p.get_width() / 2, p.get_height()), ha="center",
                       va="bottom")
    fig.tight_layout()
    out = Path(__file__).parents[1] / "docs" / "img" / "h200_prefill.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
