"""GRPO with a sequence-classification reward model that scores each group's completions from one forest.

    python examples/grpo_reward_model.py                # tiny random policy and reward model, CPU, seconds
    python examples/grpo_reward_model.py --compare      # also run trl.GRPOTrainer and check the same rewards

TRL scores every `prompt + completion` with its own padded reward-model forward, so a group of G completions runs
its prompt G times. Inside `TreeGRPOTrainer` a reward model of transformers' decoder-only
`*ForSequenceClassification` kind scores the batch from packed forests (each prompt once), reading the score at
the same token transformers reads (the last one that is not padding); refused models score flat, with the reason
logged. With `--compare` the script exits with status 1 unless every step's rewards equal TRL's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import _tiny
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer

SYSTEM = "you are a poet. answer with one short line about the given word, lowercase, no digits.\n"
WORDS = ["rain", "stone", "river", "ember", "salt", "moss", "glass", "wind"]


def run(trainer_cls, config_cls, policy, reward, args):
    config = config_cls(
        output_dir=f"{policy}/{trainer_cls.__name__}", use_cpu=not torch.cuda.is_available(), bf16=False, seed=0,
        per_device_train_batch_size=2 * args.num_generations, num_generations=args.num_generations,
        max_completion_length=args.completion_length, max_steps=args.steps, logging_steps=1, learning_rate=1e-3,
        report_to="none", save_strategy="no", model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [SYSTEM + f"word: {w}\n" for w in WORDS]})
    tokenizer = _tiny.tokenizer()
    tokenizer.padding_side = "left"  # GRPO generates from left-padded prompts
    trainer = trainer_cls(
        policy,
        reward,
        config,
        train_dataset=dataset,
        processing_class=tokenizer,
        reward_processing_classes=_tiny.tokenizer(),
    )
    _tiny.quiet(trainer)
    scores = []
    calculate = trainer._calculate_rewards

    def recording(*a):
        scores.append(calculate(*a).clone())
        return scores[-1]

    trainer._calculate_rewards = recording
    trainer.train()
    return trainer, scores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--completion_length", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compare", action="store_true", help="also run trl.GRPOTrainer; exit 1 if rewards differ")
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as root:
        policy, reward = _tiny.save_tiny(os.path.join(root, "policy")), os.path.join(root, "reward")
        _tiny.save_tiny(reward, seed=1, reward_model=True)
        trainer, scores = run(TreeGRPOTrainer, TreeGRPOConfig, policy, reward, args)
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        for step, (entry, s) in enumerate(zip(logs, scores)):
            print(
                f"step {step}: reward mean {s.mean():.4f}  reward_tree_compute_ratio "
                f"{entry['reward_tree_compute_ratio']:.3f}  reward_tree_fallback {entry['reward_tree_fallback']:.0f}"
            )
        if not args.compare:
            return 0
        _, flat = run(GRPOTrainer, GRPOConfig, policy, reward, args)
    diff = max((a - b).abs().max().item() for a, b in zip(scores, flat))
    ok = len(scores) == len(flat) and diff <= args.atol
    print(f"max |tree - trl.GRPOTrainer| reward = {diff:.2e} (atol {args.atol:.0e}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
