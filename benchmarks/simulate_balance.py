"""How evenly W data-parallel ranks are loaded: TRL's assignment of groups against the token-balanced one.

Each trial draws `W x M x K` groups (W ranks, M micro-batches per optimizer step, K groups per rank per micro-batch)
from a pool of realistic groups whose cost is `hf_tree_attn.estimate_flops` on real token sequences (a Qwen3-1.7B
shape; tree tokens, attention pairs and scored rows). TRL's assignment is the sampler's: rank r generates and trains
the groups it drew, in order. The balanced one is `hf_tree_attn.trainer.balance.assign_blocks` over the step's
window. Reported per rank count: the step cost over the ideal, `sum_m max_r C[r, m] / (total / W)` (FSDP waits for
the busiest rank in every micro-batch), mean over trials, plus a lower bound no placement of whole groups can beat
(the m-th heaviest micro-batch holds at least the (m-1)WK+1-th heaviest group).

    python benchmarks/simulate_balance.py --out benchmarks/results/balance_simulation.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
from bench_tree_vs_flat import MODELS
from harness import provenance
from transformers import Qwen3Config

from hf_tree_attn.trainer.balance import assign_blocks, block_costs, step_imbalance

VOCAB = 151936


def grpo_group(rng: np.random.Generator, g: int) -> tuple[list[np.ndarray], list[int]]:
    """A GRPO group: one prompt of U[1000, 6000] tokens, `g` completions of U[100, 1000] tokens each."""
    prompt = rng.integers(0, VOCAB, rng.integers(1000, 6001))
    seqs = [np.concatenate([prompt, rng.integers(0, VOCAB, rng.integers(100, 1001))]) for _ in range(g)]
    return seqs, [len(prompt)] * g


def agent_group(rng: np.random.Generator, g: int) -> tuple[list[np.ndarray], list[int]]:
    """A tau2-like agent task: a U[1000, 4000]-token system + task prompt, `g` rollouts of U[10, 30] turns (user /
    tool message U[40, 200] tokens, response U[80, 400]); each row is one rollout, its responses scored (the
    rollouts share the task prompt, each is a deep branch of the group's tree)."""
    system = rng.integers(0, VOCAB, rng.integers(1000, 4001))
    seqs, prompt_lengths = [], []
    for _ in range(g):
        parts = [system]
        for _ in range(rng.integers(10, 31)):
            parts.append(rng.integers(0, VOCAB, rng.integers(40, 201)))
            parts.append(rng.integers(0, VOCAB, rng.integers(80, 401)))
        seqs.append(np.concatenate(parts))
        prompt_lengths.append(len(system))
    return seqs, prompt_lengths


WORKLOADS = {
    "grpo_mixed_prompts": dict(
        make=grpo_group, g=16, spec={"G": 16, "prompt": "U[1000,6000]", "completion": "U[100,1000]"}
    ),
    "tau2_like_agent": dict(
        make=agent_group,
        g=8,
        spec={"G": 8, "system": "U[1000,4000]", "turns": "U[10,30]", "user": "U[40,200]", "response": "U[80,400]"},
    ),
}


def group_pool(config, workload: dict, size: int, seed: int) -> np.ndarray:
    """Costs of `size` groups drawn from `workload`, each priced by `estimate_flops` on its token sequences."""
    rng = np.random.default_rng(seed)
    costs = []
    for _ in range(size):
        seqs, prompt_lengths = workload["make"](rng, workload["g"])
        costs.append(block_costs(config, seqs, prompt_lengths, block_size=len(seqs))[0])
    return np.array(costs)


def lower_bound(costs: np.ndarray) -> float:
    """No placement of these whole groups (same K per rank per micro-batch) has a smaller step imbalance."""
    world, micro, blocks = costs.shape
    ranked = np.sort(costs.reshape(-1))[::-1]
    floor = sum(ranked[m * world * blocks] for m in range(micro))
    return max(1.0, float(floor / (costs.sum() / world)))


def simulate(pool: np.ndarray, world: int, micro: int, blocks: int, trials: int, rng) -> dict:
    trl, balanced, bound = [], [], []
    for _ in range(trials):
        costs = rng.choice(pool, size=(world, micro, blocks))  # the sampler's order: rank r trains what it drew
        source = assign_blocks(costs, window=micro)
        moved = costs[source[..., 0], source[..., 1], source[..., 2]]
        trl.append(step_imbalance(costs))
        balanced.append(step_imbalance(moved))
        bound.append(lower_bound(costs))
    return {
        "imbalance_trl": float(np.mean(trl)),
        "imbalance_trl_p90": float(np.percentile(trl, 90)),
        "imbalance_balanced": float(np.mean(balanced)),
        "imbalance_balanced_p90": float(np.percentile(balanced, 90)),
        "lower_bound": float(np.mean(bound)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--groups-per-micro-batch", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 8], help="per optimizer step")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--pool", type=int, default=256, help="distinct groups priced per workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/balance_simulation.json")
    args = parser.parse_args()

    config = Qwen3Config(**MODELS["qwen3-1.7b"])
    results = {
        **provenance(),
        "machine": f"CPU ({platform.machine()}), python {platform.python_version()}, numpy {np.__version__}",
        "model_shape": "qwen3-1.7b",
        "cost": "hf_tree_attn.estimate_flops tree_flops of each group (forward; backward has the same ratio)",
        "imbalance": "sum over micro-batches of the busiest rank's cost / (total cost / ranks), mean over trials",
        "trials": args.trials,
        "workloads": {},
    }
    rng = np.random.default_rng(args.seed)
    print(f"{'workload':<20} {'K':>2} {'M':>2} " + " ".join(f"{'W=' + str(w):>15}" for w in args.ranks))
    for name, workload in WORKLOADS.items():
        t0 = time.perf_counter()
        pool = group_pool(config, workload, args.pool, args.seed)
        entry = {
            "spec": workload["spec"],
            "pool_cost_max_over_mean": float(pool.max() / pool.mean()),
            "pool_seconds": time.perf_counter() - t0,
            "settings": [],
        }
        for blocks in args.groups_per_micro_batch:
            for micro in args.micro_batches:
                by_ranks = {str(w): simulate(pool, w, micro, blocks, args.trials, rng) for w in args.ranks}
                setting = {"groups_per_micro_batch": blocks, "micro_batches": micro, "by_ranks": by_ranks}
                entry["settings"].append(setting)
                cells = " ".join(
                    f"{r['imbalance_trl']:>6.3f}->{r['imbalance_balanced']:<6.3f}" + " *"[r["lower_bound"] > 1.05]
                    for r in by_ranks.values()
                )
                print(f"{name:<20} {blocks:>2} {micro:>2} {cells}", flush=True)
        results["workloads"][name] = entry
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("TRL -> balanced step imbalance; * = the lower bound is above 1.05 (the groups do not allow it)")


if __name__ == "__main__":
    main()
