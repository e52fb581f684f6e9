"""Plot a `bench_tree_vs_flat.py` result: tree speedup vs the best flat baseline next to its ceilings.

python benchmarks/plot_results.py benchmarks/results/tree_vs_flat_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: next to the first JSON)")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = [json.loads(path.read_text()) for path in args.results]
    data = files[0]
    by_key = {}
    for result in files:
        for run in result["runs"]:
            by_key[(run["model"], run["workload"])] = run
    runs = list(by_key.values())
    labels = [f"{r['model']}\n{r['workload'].removeprefix('grpo_')}" for r in runs]
    xs = range(len(runs))
    width = 0.2
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(runs)), 5))
    series = [
        ("token ceiling", [r["token_ceiling"] for r in runs], "#d9d9d9"),
        ("FLOP ceiling", [r["flop_ceiling"] for r in runs], "#9ecae1"),
        ("tree vs flat padded (SDPA)", [r["speedup_vs_padded"] for r in runs], "#fd8d3c"),
        ("tree vs best flat", [r["speedup_vs_best_flat"] for r in runs], "#d94801"),
    ]
    for k, (name, values, color) in enumerate(series):
        bars = ax.bar([x + (k - 1.5) * width for x in xs], values, width, label=name, color=color)
        if k == 3:
            for bar, r in zip(bars, runs):
                ax.annotate(f"{r['pct_of_token_ceiling']:.0f}%", (bar.get_x() + width / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("trainer-phase speedup (×)")
    ax.set_title(f"hf_tree_attn tree vs flat — {data['gpu']}, torch {data['versions']['torch']} "
                 "(label: % of token ceiling)", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = args.out or args.results[0].with_suffix(".png")
    fig.savefig(out, dpi=130)
    print(out)


if __name__ == "__main__":
    main()
