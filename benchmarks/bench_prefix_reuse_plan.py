"""Forwarded over unique tokens of one optimizer step: micro-batches that repeat their prefix vs prefix reuse.

No model runs here, only the layouts (CPU, seconds). A step's sequences are laid out two ways:

- `split`: `pack_forest(sequences, max_tokens_per_mb=budget, two_level=False)`, what the trainers do without
  `tree_prefix_reuse`: micro-batches of whole tries, each repeating the prefix its sequences need; a sequence longer
  than the budget is refused;
- `reuse`: the step as one forest in chunks of `budget` rows (`tree_prefix_reuse=True`, `hf_tree_attn.chunked`):
  every row forwarded once, each chunk attending to the keys and values its context rows left in the kept store.

Per workload and budget: the step's unique tokens (its prefix forest's rows), forwarded tokens and their ratio to
the unique ones for both layouts, the chunks and kept rows of `reuse`, and per model shape (random-weight configs on
the meta device, bf16, every layer checkpointed as the trainers' default recompute) the planner's estimate of the
backward's peak beyond weights and optimizer state (`hf_tree_attn.reuse_planner`: the largest chunk's activations,
its context, the kept keys and values and their float32 gradients) at chunks of the budget, and the chunk size of
the least estimate. Forwarded counts the forward passes' rows: both
layouts then recompute each checkpointed layer once in the backward, as a step without prefix reuse does. Workloads
(token counts drawn with a fixed seed):

- `agent_4x20`: 4 agent conversations of 20 turns sharing a 4,096-token system prompt, each turn 1,700 tool and user
  tokens then a 600-token answer; one sample per answer holding the whole history before it;
- `agent_2x20x4`: 2 such conversations with 4 sampled answers per turn (the first continues the conversation);
- `grpo_4x16`: 4 groups of G=16, prompts and completions U[1,000, 8,000] tokens;
- `trajectory_96k`: one 96k-token trajectory with 8 branches of 2,048 tokens forking along it (every 12k tokens),
  budget 32k: longer than any micro-batch.

    python benchmarks/bench_prefix_reuse_plan.py --out benchmarks/results/prefix_reuse_plan_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_tree_vs_flat import MODELS  # noqa: E402
from harness import provenance  # noqa: E402

from hf_tree_attn import pack_forest  # noqa: E402
from hf_tree_attn.reuse_planner import plan_prefix_reuse, reuse_estimate  # noqa: E402

GIB = 2**30


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 150_000) for _ in range(n)]


def agent(conversations: int, turns: int, answers: int, seed: int = 0) -> list[list[int]]:
    """Per-turn samples of `conversations` agent conversations sharing one system prompt (module docstring)."""
    rng = random.Random(seed)
    system, samples = _tokens(rng, 4096), []
    for _ in range(conversations):
        history = list(system)
        for _ in range(turns):
            history += _tokens(rng, 1700)
            sampled = [_tokens(rng, 600) for _ in range(answers)]
            samples += [history + answer for answer in sampled]
            history += sampled[0]
    return samples


def grpo(groups: int, size: int, seed: int = 0) -> list[list[int]]:
    """`groups` prompts of U[1k, 8k] tokens with `size` completions of U[1k, 8k] each."""
    rng = random.Random(seed)
    samples = []
    for _ in range(groups):
        prompt = _tokens(rng, rng.randint(1000, 8000))
        samples += [prompt + _tokens(rng, rng.randint(1000, 8000)) for _ in range(size)]
    return samples


def trajectory(length: int = 96 * 1024, branches: int = 8, branch: int = 2048, seed: int = 0) -> list[list[int]]:
    """One trajectory of `length` tokens and `branches` samples forking from it at evenly spaced points."""
    rng = random.Random(seed)
    trunk = _tokens(rng, length)
    forks = [length * (k + 1) // (branches + 1) for k in range(branches)]
    return [trunk] + [trunk[:at] + _tokens(rng, branch) for at in forks]


WORKLOADS = {
    "agent_4x20": (lambda: agent(4, 20, 1), 64 * 1024),
    "agent_2x20x4": (lambda: agent(2, 20, 4), 64 * 1024),
    "grpo_4x16": (lambda: grpo(4, 16), 32 * 1024),
    "trajectory_96k": (trajectory, 32 * 1024),
}


def meta_model(name: str) -> torch.nn.Module:
    """A random-weight causal LM of `name`'s shape on the meta device (no memory), bf16, every layer checkpointed."""
    config = Qwen3Config(**MODELS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def measure(name: str, models: dict[str, torch.nn.Module]) -> dict:
    build, budget = WORKLOADS[name]
    sequences = build()
    (forest,) = pack_forest(sequences, two_level=False)  # the whole step: its unique tokens
    unique = forest.num_tree_tokens
    row = {"sequences": len(sequences), "longest": max(map(len, sequences)), "budget": budget, "unique": unique}
    try:
        split = pack_forest(sequences, max_tokens_per_mb=budget, two_level=False)
        forwarded = sum(f.num_tree_tokens for f in split)
        row["split"] = {
            "micro_batches": len(split),
            "forwarded": forwarded,
            "forwarded_over_unique": forwarded / unique,
        }
    except ValueError as error:
        row["split"] = {"refused": str(error).split(". ")[0]}
    row["reuse"] = {}
    for model_name, model in models.items():
        plan = plan_prefix_reuse(model, forest, max_chunk_rows=budget, block=128)
        chunks = plan.chunks
        row["reuse"][model_name] = {
            "chunks": chunks.num_chunks,
            "forwarded": chunks.forwarded_rows,
            "forwarded_over_unique": chunks.forwarded_rows / unique,
            "kept_rows": len(chunks.kept_rows),
            "estimate_gib": {
                "activations": plan.activations / GIB, "context": plan.context / GIB, "kept_kv": plan.kept_kv / GIB,
                "kv_grad": plan.kv_grad / GIB, "total": plan.total / GIB,
            },
            "least": least(model, forest, budget),
        }  # fmt: skip
    return row


def least(model: torch.nn.Module, forest, budget: int, block: int = 128) -> dict:
    """The chunk size (a multiple of `block`, at most `budget`) whose estimated peak is the least, and that peak."""
    totals = {rows: sum(reuse_estimate(model, forest, rows, block=block)) for rows in range(block, budget + 1, block)}
    rows = min(totals, key=totals.get)
    return {"chunk_rows": rows, "total_gib": totals[rows] / GIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b", "qwen3-8b"], choices=list(MODELS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    models = {name: meta_model(name) for name in args.models}
    results = {**provenance(), "rows": {}}
    for name in args.workloads:
        row = results["rows"][name] = measure(name, models)
        split = row["split"]
        today = split.get("refused") or f"{split['forwarded_over_unique']:.3f}x in {split['micro_batches']} forwards"
        print(f"{name:<15} unique {row['unique']:>9,}  budget {row['budget']:>6,}  split: {today}")
        for model_name, reuse in row["reuse"].items():
            gib = reuse["estimate_gib"]
            print(f"  reuse {model_name:<11} {reuse['forwarded_over_unique']:.3f}x in {reuse['chunks']} chunks, "
                  f"{reuse['kept_rows']:,} kept rows; peak estimate {gib['total']:.1f} GiB (kept K/V "
                  f"{gib['kept_kv']:.1f} + grads {gib['kv_grad']:.1f}, activations {gib['activations']:.1f}); least "
                  f"{reuse['least']['total_gib']:.1f} GiB at {reuse['least']['chunk_rows']:,}-row chunks")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
