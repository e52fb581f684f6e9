"""The work each layout of `bench_prefix_reuse_gpu.py` executes, counted from its FLOPs, against the step times a
result file measured: how much of prefix reuse's speed against the split its FLOPs predict, and how fast each
layout ran the FLOPs it executed. CPU, no model run.

Executed FLOPs per step, forward and backward (the backward counted as two forwards, as `hf_tree_attn.metrics`
does), from `hf_tree_attn.metrics.estimate_row_flops` on the rows each forward runs (a row at depth `t` attending to
its `t + 1` ancestors-or-self, a chunk's context rows included; the LM head on every row, as the benchmark scores
every token):

- `split`: each micro-batch of `pack_forest(sequences, max_tokens_per_mb=budget)` forwarded once, its decoder
  layers recomputed once more in the backward where the model checkpoints them (`checkpointing="all"`):
  `layers x (3 + 1) + head x 3` per micro-batch, the rows the micro-batches repeat included.
- `reuse`: the step as one forest in chunks of `budget` rows (`hf_tree_attn.chunked.plan_chunks`), each row
  forwarded once; every chunk whose forward graph is not kept for the backward is forwarded once more there, head
  included (`layers x (4 + 1) + head x 4` with checkpointed layers), the kept ones (the last: `keep_graphs=1`) as
  the split's micro-batches; `reuse_kept` keeps every chunk's graph.

`predicted`: the split's executed FLOPs over the layout's (> 1: prefix reuse should be faster by its FLOPs);
`measured`: the file's paired median (the split's seconds over the layout's, per step); `rate`: executed FLOPs per
median step second over 989 TFLOP/s. Where `measured` falls short of `predicted`, the layout ran its FLOPs more
slowly than the split ran its own (`rate` says by how much): kernel efficiency, not work.

    python benchmarks/prefix_reuse_work.py benchmarks/results/prefix_reuse_gpu_h200_qwen3-0.6b.json \\
        benchmarks/results/prefix_reuse_gpu_h200_qwen3-1.7b.json --out benchmarks/results/prefix_reuse_work_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_prefix_reuse_gpu import WORKLOADS  # noqa: E402
from bench_tree_vs_flat import CONFIG_CLASSES, MODELS, PEAK_FLOPS  # noqa: E402
from harness import provenance  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

from hf_tree_attn import pack_forest  # noqa: E402
from hf_tree_attn.chunked import plan_chunks  # noqa: E402
from hf_tree_attn.metrics import estimate_row_flops  # noqa: E402
from hf_tree_attn.support import rope_split_lengths  # noqa: E402

METHODS = ("split", "reuse", "reuse_kept")


def executed_flops(config, sequences, budget: int, checkpointing: str = "all") -> dict:
    """Forward + backward FLOPs each layout executes on one step of `sequences` (module docstring), with the rows each
    forwards: `{method: {"flops", "forwarded_rows"}}`."""
    recompute = 1 if checkpointing == "all" else 0
    split_flops = split_rows = 0
    for forest in pack_forest(sequences, max_tokens_per_mb=budget, split_lengths=rope_split_lengths(config)):
        layers, head = estimate_row_flops(config, forest.position_ids[0, : forest.num_tree_tokens].numpy())
        split_flops += layers * (3 + recompute) + head * 3
        split_rows += forest.num_tree_tokens
    (forest,) = pack_forest(sequences, two_level=False)
    plan = plan_chunks(forest, budget)
    depths = forest.position_ids[0].numpy()
    run = [(int(a), int(b)) for a, b, needed in zip(plan.bounds[:-1], plan.bounds[1:], plan.needed) if needed]
    chunks = [estimate_row_flops(config, depths[a:b]) for a, b in run]  # a chunk scoring nothing is not forwarded
    kept = [(layers * (3 + recompute) + head * 3) for layers, head in chunks]
    recomputed = [(layers * (4 + recompute) + head * 4) for layers, head in chunks]
    rows = sum(b - a for a, b in run)
    return {
        "split": {"flops": split_flops, "forwarded_rows": split_rows},
        "reuse": {"flops": sum(recomputed[:-1]) + kept[-1], "forwarded_rows": rows},
        "reuse_kept": {"flops": sum(kept), "forwarded_rows": rows},
    }


def work_row(row: dict, checkpointing: str) -> dict:
    """One result row's work model: each measured layout's executed FLOPs, predicted and measured speed against the
    split, and the rate it ran its FLOPs at."""
    build, _ = WORKLOADS[row["workload"]]
    config = CONFIG_CLASSES.get(row["model"], Qwen3Config)(**MODELS[row["model"]])
    work = executed_flops(config, build(), row["budget"], checkpointing)
    out = {key: row[key] for key in ("model", "workload", "budget", "unique")}
    out["methods"] = {}
    for method in METHODS:
        result = row["methods"].get(method)
        if result is None or "measured_step_s" not in result:
            continue
        median = statistics.median(result["measured_step_s"])
        entry = {"executed_pflop": work[method]["flops"] / 1e15, "forwarded_rows": work[method]["forwarded_rows"],
                 "median_step_s": median, "rate": work[method]["flops"] / median / PEAK_FLOPS}  # fmt: skip
        if method != "split" and "split" in out["methods"]:
            entry["predicted"] = work["split"]["flops"] / work[method]["flops"]
            pair = row.get("paired" if method == "reuse" else "paired_kept") or {}
            if "median" in pair:
                entry["measured"] = pair["median"]
        out["methods"][method] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="bench_prefix_reuse_gpu.py result files")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for path in args.files:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            if "split" not in row["methods"]:
                continue  # nothing to compare with (a sequence longer than the budget)
            work = work_row(row, data.get("checkpointing", "all"))
            work["source"] = path.name
            rows.append(work)
            for method, entry in work["methods"].items():
                extra = ""
                if "predicted" in entry:
                    extra = (
                        f"  predicted {entry['predicted']:.2f}x, measured {entry.get('measured', float('nan')):.2f}x"
                    )
                print(f"{row['model']} {row['workload']} {method}: {entry['executed_pflop']:.2f} PFLOP executed, "
                      f"{100 * entry['rate']:.1f}% of peak{extra}")  # fmt: skip
    args.out.write_text(json.dumps({**provenance(), "peak_flops": PEAK_FLOPS, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
