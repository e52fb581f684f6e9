"""Model-FLOPs utilisation of `bench_tree_vs_flat.py` result files that do not record it (CPU only).

Rebuilds each run's workload from its recorded scale (the benchmark's workloads are seeded), prices it with
`estimate_flops`, and divides 4 forwards' model FLOPs (old-logprob forward, policy forward, backward; recompute not
counted) by the recorded time and `PEAK_FLOPS` — the same definition as the benchmark's `mfu`.

    cd benchmarks/results && python ../mfu_of_results.py tree_vs_flat_h200_qwen3-1.7b_agent.json:0.5 \\
        tree_vs_flat_h200_qwen3-8b.json:0.25
"""

from __future__ import annotations

import argparse
import json

from bench_tree_vs_flat import MODELS, PEAK_FLOPS, build_workloads
from transformers import Qwen3Config

import hf_tree_attn


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="FILE:SCALE (the --scale the file was made with)")
    args = parser.parse_args()
    print(f"{'model':<11} {'workload':<22} {'tree mfu':>8} {'best flat mfu':>13}")
    for item in args.results:
        path, scale = item.rsplit(":", 1)
        built = {w.name: w for w in build_workloads(float(scale), MODELS["qwen3-0.6b"]["vocab_size"])}
        with open(path) as f:
            runs = json.load(f)["runs"]
        for run in runs:
            wl = built[run["workload"]]
            if len(wl.sequences) != run["num_sequences"] or sum(map(len, wl.sequences)) != run["total_tokens"]:
                raise ValueError(f"{path}: {run['workload']} does not match scale {scale}; pass the file's --scale.")
            flops = hf_tree_attn.estimate_flops(Qwen3Config(**MODELS[run["model"]]), wl.sequences, wl.prompt_lengths)
            tree = 4 * flops["tree_flops"] / run["tree"]["time_s"] / PEAK_FLOPS
            flat = (
                4 * flops["flat_flops"] / min(run["flat_padded"]["time_s"], run["flat_packed"]["time_s"]) / PEAK_FLOPS
            )
            print(f"{run['model']:<11} {run['workload']:<22} {100 * tree:>7.1f}% {100 * flat:>12.1f}%")


if __name__ == "__main__":
    main()
