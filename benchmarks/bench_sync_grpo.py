"""TreeGRPOTrainer vs trl.GRPOTrainer through `trainer.train()` at TRL's defaults, one GPU, same completions.

The synchronous pair: generation is TRL's `rollout_func` (`bench_balance_fsdp.stub_rollout`: the prompt's tokens and
random completions seeded by the prompt, so both trainers train on the same rows; generation itself costs nothing
here), everything else is each trainer's default path — `trl.GRPOTrainer` with `GRPOConfig`'s defaults (padded rows,
SDPA, gradient checkpointing, bf16) and `TreeGRPOTrainer` with `TreeGRPOConfig`'s (the same plus trees). Random
bf16 weights from a config shaped like Qwen3-1.7B / 8B (no download), a character tokenizer. One group of G=16
completions per optimizer step (`per_device_train_batch_size=16`, `num_generations=16`). Workloads:

- `grpo_P4096_C512`: 4,096-token prompts, 512-token completions;
- `grpo_mixed`: prompts U[1000, 6000] tokens, completions U[64, 1024].

Per trainer: the wall time of each optimizer step after `--warmup` steps (CUDA-synchronized), completion tokens
trained per second, peak memory, and `mfu`: 3x the forward FLOPs each method's layout needs (`estimate_flops`:
the unpadded sequences for TRL, their prefix forest for the tree; forward + backward, recompute not counted) per
step second over 989 TFLOP/s.

    python benchmarks/bench_sync_grpo.py --models qwen3-1.7b --workloads grpo_P4096_C512 grpo_mixed \\
        --out benchmarks/results/sync_grpo_h200_qwen3-1.7b.json
    python benchmarks/bench_sync_grpo.py --models tiny --scale 0.02 --steps 1    # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import random
import statistics
import sys
import warnings
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_async_grpo import StepClock, model_config  # noqa: E402
from bench_balance_fsdp import length_reward, stub_rollout  # noqa: E402
from bench_tree_vs_flat import MODELS, PEAK_FLOPS  # noqa: E402

import hf_tree_attn  # noqa: E402
from hf_tree_attn.metrics import estimate_flops  # noqa: E402
from trainers import toy_task  # noqa: E402

WORKLOADS = {"grpo_P4096_C512": ((4096, 4096), (512, 512)), "grpo_mixed": ((1000, 6000), (64, 1024))}


def recording(rollout, calls: list):
    """`rollout` that also records each call's `(prompt_ids, completion_ids)`: one call per optimizer step."""

    def rollout_func(prompts, trainer):
        out = rollout(prompts, trainer)
        calls.append((out["prompt_ids"], out["completion_ids"]))
        return out

    return rollout_func


def run(tree: bool, base, dataset, tokenizer, workload: str, args) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer

    config_class, trainer_class = (TreeGRPOConfig, TreeGRPOTrainer) if tree else (GRPOConfig, GRPOTrainer)
    cuda = torch.cuda.is_available()
    training_args = config_class(
        output_dir=f"/tmp/bench_sync_grpo/{trainer_class.__name__}", per_device_train_batch_size=16,
        num_generations=16, max_completion_length=round(1024 * args.scale), max_steps=args.warmup + args.steps,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0, bf16=cuda,
        use_cpu=not cuda,
    )  # fmt: skip
    clock, calls = StepClock(args.warmup), []
    rollout = recording(stub_rollout(args.scale, WORKLOADS[workload][1]), calls)
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(model, length_reward, training_args, train_dataset=dataset,
                                processing_class=tokenizer, callbacks=[clock], rollout_func=rollout)  # fmt: skip
        trainer.train()
    config = base.config
    times = clock.step_times()
    flops, completions = [], []
    for prompt_ids, completion_ids in calls[args.warmup : args.warmup + len(times)]:
        sequences = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        estimate = estimate_flops(config, sequences, prompt_lengths=[len(p) for p in prompt_ids])
        flops.append(3 * estimate["tree_flops" if tree else "flat_flops"])
        completions.append(sum(len(c) for c in completion_ids))
    logs = [entry for entry in trainer.state.log_history if "loss" in entry][args.warmup :]
    result = {
        "step_s": times,
        "median_step_s": statistics.median(times),
        "completion_tokens_per_step": completions,
        "trained_tokens_per_s": statistics.mean(completions) / statistics.median(times),
        "mfu": statistics.mean(f / t / PEAK_FLOPS for f, t in zip(flops, times)),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "loss": [entry["loss"] for entry in logs],
        "tree_fallback": [entry.get("tree_fallback") for entry in logs] if tree else None,
    }
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b"], choices=[*MODELS, "tiny"])
    parser.add_argument("--workloads", nargs="+", default=["grpo_P4096_C512"], choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=2, help="measured optimizer steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0, help="scale every length (CPU smoke runs)")
    parser.add_argument("--out", default="benchmarks/results/sync_grpo.json")
    args = parser.parse_args()

    import trl
    from datasets import Dataset

    cuda = torch.cuda.is_available()
    tokenizer = toy_task.build_tokenizer()
    alphabet = toy_task.CHARS[:-1]
    results = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "hf_tree_attn": hf_tree_attn.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "per_step": "one prompt, G=16 completions (per_device_train_batch_size=16, num_generations=16)",
        "peak_flops": PEAK_FLOPS,
        "rows": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for model_name in args.models:
        config = model_config(model_name)
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        torch.manual_seed(0)
        with torch.device("cuda" if cuda else "cpu"):
            base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
        for workload in args.workloads:
            rng = random.Random(0)
            low, high = (round(n * args.scale) for n in WORKLOADS[workload][0])
            prompts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(low, high))) for _ in range(16)]
            dataset = Dataset.from_dict({"prompt": prompts})
            row = {"model": model_name, "workload": workload, "sides": {}}
            for side in ("trl", "tree"):
                row["sides"][side] = run(side == "tree", base, dataset, tokenizer, workload, args)
            trl_side, tree_side = row["sides"]["trl"], row["sides"]["tree"]
            row["speedup_tree_vs_trl"] = trl_side["median_step_s"] / tree_side["median_step_s"]
            row["same_completions"] = trl_side["completion_tokens_per_step"] == tree_side["completion_tokens_per_step"]
            if trl_side["peak_gib"]:
                row["peak_tree_over_trl"] = tree_side["peak_gib"] / trl_side["peak_gib"]
            results["rows"].append(row)
            out.write_text(json.dumps(results, indent=1))
            print(f"{model_name:<12} {workload:<16} trl {trl_side['median_step_s']:.3f} s  tree "
                  f"{tree_side['median_step_s']:.3f} s  -> {row['speedup_tree_vs_trl']:.2f}x  mfu "
                  f"{100 * trl_side['mfu']:.1f}% / {100 * tree_side['mfu']:.1f}%", flush=True)  # fmt: skip
        del base
        gc.collect()


if __name__ == "__main__":
    main()
