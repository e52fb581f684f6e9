"""TreeGRPOTrainer vs trl.GRPOTrainer through `trainer.train()`, one GPU, the same completions, each in its process.

The synchronous pair: generation is TRL's `rollout_func` (`bench_balance_fsdp.stub_rollout`: the prompt's tokens and
random completions seeded by the prompt, so both trainers train on the same rows; generation itself costs nothing
here), everything else is each trainer's default path — `trl.GRPOTrainer` with `GRPOConfig`'s defaults (padded rows,
SDPA, gradient checkpointing, bf16) and `TreeGRPOTrainer` with `TreeGRPOConfig`'s (the same plus trees; on CUDA its
decoder layers compiled). Random bf16 weights from a config shaped like Qwen3-1.7B / 8B (no download), a character
tokenizer. One group of G=16 completions per optimizer step (`per_device_train_batch_size=16`,
`num_generations=16`). Sides (`bench_async_grpo.SIDES` names): `trl`, `trl_compiled` (accelerate's regional
compilation, dynamic shapes), `tree`, `tree_eager` (`tree_compile=False`), `reference` (TRL's trainer in float32,
its first policy forward without autograd, then stopped: the exact values the agreement checks measure against).
Workloads:

- `grpo_P4096_C512`: 4,096-token prompts, 512-token completions;
- `grpo_mixed`: prompts U[1000, 6000] tokens, completions U[64, 1024].

Per side: the wall time of every optimizer step (CUDA-synchronized; the first from `train()`'s start), completion
tokens trained per second, peak memory after the warm-up, and `mfu`: 3x the forward FLOPs of the step's sequences
as one prefix forest (`estimate_flops`' `tree_flops`; forward + backward, recompute not counted) per step second
over 989 TFLOP/s — one formula for both sides. Per row, `paired` and `agreement` as in `bench_async_grpo.py`: per
measured step the reference's seconds over the candidate's, and the first policy forward's per-token
log-probabilities of the completion tokens, each side's error to the float32 `reference` at most twice the other's
(targets compared first), with `tree_fallback == 0` on the tree side.

    python benchmarks/bench_sync_grpo.py --models qwen3-1.7b --workloads grpo_P4096_C512 grpo_mixed \\
        --sides reference trl tree --out benchmarks/results/sync_grpo_h200_qwen3-1.7b_paired.json
    python benchmarks/bench_sync_grpo.py --models tiny --scale 0.02 --warmup 1 --steps 8    # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from bench_async_grpo import SIDES, ScoresTaken, _summary, model_config  # noqa: E402
from bench_balance_fsdp import length_reward, stub_rollout  # noqa: E402
from bench_tree_vs_flat import MODELS, PEAK_FLOPS  # noqa: E402
from harness import (  # noqa: E402
    StepClock,
    compile_report,
    pair_sides,
    provenance,
    result_file,
    run_child,
    run_rows,
    side_arguments,
)

from hf_tree_attn.metrics import estimate_flops  # noqa: E402
from trainers import toy_task  # noqa: E402

WORKLOADS = {"grpo_P4096_C512": ((4096, 4096), (512, 512)), "grpo_mixed": ((1000, 6000), (64, 1024))}
SYNC_SIDES = ("trl", "trl_compiled", "tree", "tree_eager", "reference")
PAIRS = [("tree", "trl"), ("tree", "trl_compiled"), ("tree_eager", "trl"), ("tree", "tree_eager")]
PROMPTS = 16  # one per optimizer step: warm-up + measured steps must not exceed it


def recording(rollout, calls: list):
    """`rollout` that also records each call's `(prompt_ids, completion_ids)`: one call per optimizer step."""

    def rollout_func(prompts, trainer):
        out = rollout(prompts, trainer)
        calls.append((out["prompt_ids"], out["completion_ids"]))
        return out

    return rollout_func


class FirstScores:
    """The first policy forward's completion-token log-probabilities (`_get_per_token_logps_and_entropies`, the hook
    both trainers run) and their target tokens, row by row, the rows in the order of their tokens. `stop`: run that
    forward without autograd and raise `ScoresTaken` (no backward, no optimizer state: the float32 reference of an 8B
    model fits)."""

    def __init__(self, stop: bool = False):
        self.targets, self.log_probs, self.stop = None, None, stop

    def install(self, trainer):
        hook = trainer._get_per_token_logps_and_entropies

        def recording(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            first = self.targets is None and torch.is_grad_enabled()  # the policy forward (the others run no_grad)
            with torch.no_grad() if first and self.stop else contextlib.nullcontext():
                out = hook(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            if first:
                # TRL shuffles a generation batch's rows, the tree keeps each group in order: rows sorted by content.
                mask = attention_mask[:, -logits_to_keep:].bool()
                rows = sorted(
                    (ids[m].tolist(), logps[m].float().tolist())
                    for ids, logps, m in zip(input_ids[:, -logits_to_keep:], out[0].detach(), mask)
                )
                self.targets = [t for ids, _ in rows for t in ids]
                self.log_probs = [v for _, values in rows for v in values]
                if self.stop:
                    raise ScoresTaken
            return out

        trainer._get_per_token_logps_and_entropies = recording


def side_main(args) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer

    tree, fields, _ = SIDES[args.side]
    config_class, trainer_class = (TreeGRPOConfig, TreeGRPOTrainer) if tree else (GRPOConfig, GRPOTrainer)
    cuda = torch.cuda.is_available()
    tokenizer = toy_task.build_tokenizer()
    config = model_config(args.models[0])
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    reference = args.side == "reference"  # TRL's trainer in float32, its first policy forward: the exact scores
    with torch.device("cuda" if cuda else "cpu"):
        dtype = torch.float32 if reference else torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    workload = args.workloads[0]
    rng = random.Random(0)
    low, high = (round(n * args.scale) for n in WORKLOADS[workload][0])
    alphabet = toy_task.CHARS[:-1]
    prompts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(low, high))) for _ in range(PROMPTS)]
    training_args = config_class(
        **fields, output_dir=f"/tmp/bench_sync_grpo/{trainer_class.__name__}", per_device_train_batch_size=16,
        num_generations=16, max_completion_length=round(1024 * args.scale),
        max_steps=1 if reference else args.warmup + args.steps, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, bf16=cuda and not reference, use_cpu=not cuda,
    )  # fmt: skip
    clock, calls, scores = StepClock(args.warmup), [], FirstScores(stop=reference)
    rollout = recording(stub_rollout(args.scale, WORKLOADS[workload][1]), calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = Dataset.from_dict({"prompt": prompts})
        trainer = trainer_class(model, length_reward, training_args, train_dataset=dataset,
                                processing_class=tokenizer, callbacks=[clock], rollout_func=rollout)  # fmt: skip
        scores.install(trainer)
        with contextlib.suppress(ScoresTaken):  # the reference: its first policy forward scored, nothing more
            trainer.train()
    if reference:
        return {"first_scores": {"targets": scores.targets, "log_probs": scores.log_probs}, "dtype": "float32"}
    timing = clock.summary()
    times = timing["measured_step_s"]
    flops, completions = [], []
    for prompt_ids, completion_ids in calls[args.warmup : args.warmup + len(times)]:
        sequences = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
        estimate = estimate_flops(config, sequences, prompt_lengths=[len(p) for p in prompt_ids])
        flops.append(3 * estimate["tree_flops"])
        completions.append(sum(len(c) for c in completion_ids))
    logs = [entry for entry in trainer.state.log_history if "loss" in entry][args.warmup :]
    decision = getattr(trainer, "tree_compile", None)
    return {
        **timing,
        "median_step_s": statistics.median(times),
        "completion_tokens_per_step": completions,
        "trained_tokens_per_s": statistics.mean(completions) / statistics.median(times),
        "mfu_per_step": [f / t / PEAK_FLOPS for f, t in zip(flops, times)],
        "mfu": statistics.mean(f / t / PEAK_FLOPS for f, t in zip(flops, times)),
        "loss": [entry["loss"] for entry in logs],
        "tree_fallback": [entry.get("tree_fallback") for entry in logs] if tree else None,
        "tree_compile": None if decision is None else {"kwargs": decision.kwargs, "source": decision.source},
        "first_scores": {"targets": scores.targets, "log_probs": scores.log_probs},
        "dynamo": compile_report(trainer),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b"], choices=[*MODELS, "tiny"])
    parser.add_argument("--workloads", nargs="+", default=["grpo_P4096_C512"], choices=list(WORKLOADS))
    parser.add_argument("--sides", nargs="+", default=["trl", "tree"], choices=SYNC_SIDES)
    args = side_arguments(parser, SYNC_SIDES, "benchmarks/results/sync_grpo.json")
    if args.warmup + args.steps > PROMPTS:
        parser.error(f"--warmup {args.warmup} + --steps {args.steps} > {PROMPTS} prompts (one per step)")
    if run_child(args, side_main):
        return
    results = {
        **provenance(),
        "per_step": "one prompt, G=16 completions (per_device_train_batch_size=16, num_generations=16)",
        "peak_flops": PEAK_FLOPS,
        "rows": [],
    }
    rows = [(m, w) for m in args.models for w in args.workloads]
    out, earlier = result_file(args, results, rows)
    child = [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--scale={args.scale}"]
    run_rows(Path(__file__), out, results, rows, args.sides, {
        "argv": child, "env": lambda side: SIDES[side][2], "pair": _pair, "summary": _summary,
        "earlier": earlier})  # fmt: skip


def _pair(row: dict) -> None:
    """`row["paired"]` and `row["agreement"]` for every pair of `PAIRS` whose two sides ran (`harness.pair_sides`;
    the same data: the same completion tokens on every step)."""
    pair_sides(row, PAIRS, "bfloat16", lambda a, b: a["completion_tokens_per_step"] == b["completion_tokens_per_step"])


if __name__ == "__main__":
    main()
