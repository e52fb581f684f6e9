"""Planning a micro-batch's rows: TRL's asynchronous GRPO planner with its own rows against `PlannerRow`, on the CPU.

`TokenBudgetBatcher` (TRL's planner, run whole) drops each replayed sample of `bench_async_grpo.py`'s workloads into
a row of at most `--token-budget` unique tokens, its rows either TRL's `packing.TreeRow` (a dict lookup per token) or
`hf_tree_attn.trainer.rollout_planner.PlannerRow` (a radix trie, what `TreeAsyncGRPOTrainer` plans with). The
training loop runs this on one CPU core before each step's first forward (`get_batch_samples`), with the GPU idle,
so its seconds add to every step's. Per micro-batch: each planner's seconds, paired (TRL's / ours, same micro-batch),
after `--warmup` micro-batches; both planners must build the same micro-batches (the same samples in the same rows),
or the row is recorded as failed. The samples are cycled as the GPU benchmark's replay worker cycles them.

    python benchmarks/bench_planner.py --out benchmarks/results/planner_cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_async_grpo import model_config, workload  # noqa: E402
from harness import paired, provenance  # noqa: E402

from hf_tree_attn.trainer import trl_compat  # noqa: E402
from hf_tree_attn.trainer.rollout_planner import with_planner_rows  # noqa: E402


def as_dicts(samples: list, count: int):
    """`count` samples cycled from `samples`, as TRL's `RolloutQueueDataset` hands them to the planner."""
    for sample in itertools.islice(itertools.cycle(samples), count):
        yield {"input_ids": sample.input_ids, "completion_mask": sample.completion_mask,
               "old_log_probs": sample.old_log_probs, "advantage": sample.advantage, "group_id": sample.group_id,
               "metrics": sample.metrics}  # fmt: skip


def plan(batcher_class, samples: list, count: int, budget: int) -> tuple[list[float], list[list[list[int]]]]:
    """Each micro-batch's planning seconds, and its rows as sample indices (into the cycled stream)."""
    stream = list(as_dicts(samples, count))
    index = {id(s): i for i, s in enumerate(stream)}
    batcher = batcher_class(stream, 1, budget, {})
    seconds, batches = [], []
    t0 = time.perf_counter()
    for rows in batcher:
        seconds.append(time.perf_counter() - t0)
        batches.append([[index[id(s)] for s in row.samples] for row in rows])
        t0 = time.perf_counter()
    return seconds, batches


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--workloads", nargs="+", default=["grpo_mixed", "tau2_like"])
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/planner_cpu.json")
    args = parser.parse_args()
    from accelerate import PartialState

    PartialState()  # TRL's planner logs (a dropped sample) through accelerate's logger
    batcher = trl_compat.async_module_name("TokenBudgetBatcher")
    vocab = model_config(args.model).vocab_size
    results = {**provenance(), "token_budget": args.token_budget, "scale": args.scale, "rows": []}
    for name in args.workloads:
        samples, spec = workload(name, args.scale, vocab)
        count = len(samples)
        while True:  # enough cycled samples for warm-up + steps micro-batches (the last one never closes)
            theirs, their_batches = plan(batcher, samples, count, args.token_budget)
            if len(theirs) >= args.warmup + args.steps:
                break
            count *= 2
        ours, our_batches = plan(with_planner_rows(batcher), samples, count, args.token_budget)
        same = our_batches == their_batches
        window = slice(args.warmup, args.warmup + args.steps)
        row = {
            "workload": name, "spec": spec, "samples": count, "same_micro_batches": same,
            "samples_per_micro_batch": [sum(map(len, b)) for b in their_batches[window]],
            "trl_tree_row_s": theirs[window], "planner_row_s": ours[window],
            "paired": {**paired(theirs[window], ours[window]), "failed": not same},
            "median_s": {"trl_tree_row": statistics.median(theirs[window]),
                         "planner_row": statistics.median(ours[window])},
        }  # fmt: skip
        results["rows"].append(row)
        p = row["paired"]
        print(f"{name:<14} TRL's rows {row['median_s']['trl_tree_row']:.3f} s, PlannerRow "
              f"{row['median_s']['planner_row']:.4f} s per micro-batch: {p['median']:.1f}x [{p['min']:.1f}, "
              f"{p['max']:.1f}], same micro-batches: {same}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
