"""Data-parallel GRPO steps under FSDP2: tree vs TRL flat, token-balanced vs not, per rank.

    accelerate launch --config_file trainers/configs/fsdp2.yaml benchmarks/bench_balance_fsdp.py \\
        --out benchmarks/results/balance_fsdp2_h200.json

A Qwen3-1.7B-shaped model with random bf16 weights from its config (no download), a character tokenizer, and a
stub generator (TRL's `rollout_func`): prompts of U[1000, 6000] tokens, `G` completions of U[100, 1000] random
tokens each — generation is not what is measured. Every configuration trains `--steps` optimizer steps on the same
prompts (same seed) with `TreeGRPOTrainer` (TRL's `GRPOTrainer` code path when `tree_packing=False`); per rank it
records the optimizer-step wall time after the first (warm-up) step, the peak memory, and the logged estimated
imbalance (busiest rank's cost / mean, summed over micro-batches) before and after balancing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
from accelerate.utils import gather_object
from transformers import AutoModelForCausalLM, Qwen3Config, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_tree_vs_flat import MODELS  # noqa: E402
from harness import provenance  # noqa: E402

from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer  # noqa: E402
from trainers import toy_task  # noqa: E402

# A shape to try the script on CPU (`--model tiny --length-scale 0.05`, plain `accelerate launch`, no FSDP there).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip

CONFIGS = {
    "flat": dict(tree_packing=False),
    "tree": dict(tree_balance=False),
    "tree_balanced": dict(tree_balance=True),
    "tree_balanced_recompute_all": dict(tree_balance=True, tree_recompute="all"),
}


def stub_rollout(length_scale: float, completion_range: tuple[int, int] = (100, 1000)):
    """TRL `rollout_func`: the prompt's tokens and a random completion of U[completion_range] tokens (times
    `length_scale`) per row, seeded by the prompt and its index in the group: every configuration trains on the same
    completions."""
    low, high = (round(n * length_scale) for n in completion_range)

    def rollout(prompts: list[str], trainer) -> dict:
        prompt_ids = trainer.processing_class(prompts, add_special_tokens=False)["input_ids"]
        completion_ids, seen = [], {}
        for prompt in prompts:
            k = seen[prompt] = seen.get(prompt, -1) + 1
            rng = random.Random(zlib.crc32(prompt.encode()) * 64 + k)
            length = rng.randint(low, high)
            completion_ids.append([rng.randrange(3, 40) for _ in range(length)])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def length_reward(completions: list[str], **kwargs) -> list[float]:
    return [(len(c) % 7) / 7 for c in completions]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if state.global_step == 1:  # after the warm-up step: peak memory of the measured steps
                torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", choices=[*MODELS, "tiny"])
    parser.add_argument("--length-scale", type=float, default=1.0, help="scale prompt and completion lengths")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is warm-up")
    parser.add_argument("--per-device-batch", type=int, default=16, help="rows per micro-batch (G=8: 2 groups)")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--out", default="benchmarks/results/balance_fsdp2.json")
    args = parser.parse_args()

    tokenizer = toy_task.build_tokenizer()
    rng = random.Random(0)
    alphabet = toy_task.CHARS[:-1]
    lengths = [rng.randint(round(1000 * args.length_scale), round(6000 * args.length_scale)) for _ in range(256)]
    prompts = ["".join(rng.choice(alphabet) for _ in range(n)) for n in lengths]
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": prompts})
    torch.manual_seed(0)
    shape = TINY if args.model == "tiny" else MODELS[args.model]
    config = Qwen3Config(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex", dtype=torch.bfloat16)

    cuda = torch.cuda.is_available()
    results = {}
    for name in args.configs:
        training_args = TreeGRPOConfig(
            output_dir=f"/tmp/bench_balance_fsdp/{name}",
            bf16=cuda,
            use_cpu=not cuda,
            per_device_train_batch_size=args.per_device_batch,
            gradient_accumulation_steps=args.accumulation,
            num_generations=8,
            max_completion_length=1024,
            max_steps=args.steps,
            learning_rate=1e-6,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            **CONFIGS[name],
        )
        timer = StepTimer()
        trainer = TreeGRPOTrainer(
            copy.deepcopy(base), length_reward, training_args, train_dataset=dataset, processing_class=tokenizer,
            callbacks=[timer], rollout_func=stub_rollout(args.length_scale),
        )  # fmt: skip
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        rank = {
            "step_times_s": timer.times,
            "median_step_s": statistics.median(timer.times[1:]) if len(timer.times) > 1 else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        }
        ranks = gather_object([rank])
        summary = {key: statistics.mean(e[key] for e in logs if key in e) for key in logs[0] if key != "step"}
        results[name] = {"per_rank": ranks, **{k: summary.get(k) for k in (
            "loss", "balance/imbalance_before", "balance/imbalance_after", "tree_checkpointed_layers",
            "tree_fallback", "tree_token_ratio", "completions/mean_length")}}  # fmt: skip
        if trainer.accelerator.is_main_process:
            medians = [r["median_step_s"] for r in ranks]
            peaks = [r["peak_gib"] and round(r["peak_gib"], 1) for r in ranks]
            print(f"{name:<30} step {medians} s  peak {peaks} GiB  imbalance "
                  f"{summary.get('balance/imbalance_before')} -> {summary.get('balance/imbalance_after')}",
                  flush=True)  # fmt: skip
        trainer.accelerator.free_memory()
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        out = {
            **provenance(),  # under `accelerate launch` / `torchrun`: see `world_size`
            "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "devices": [torch.cuda.get_device_name() if cuda else "cpu"] * max(1, len(results[name]["per_rank"])),
            "model_shape": args.model,
            "workload": {
                "prompt": "U[1000,6000]",
                "completion": "U[100,1000]",
                "length_scale": args.length_scale,
                "G": 8,
                "per_device_train_batch_size": args.per_device_batch,
                "gradient_accumulation_steps": args.accumulation,
            },  # fmt: skip
            "configs": results,
        }
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
