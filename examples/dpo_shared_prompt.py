"""DPO on preference pairs whose prompts share a long system prompt, with `TreeDPOTrainer`.

    python examples/dpo_shared_prompt.py                # tiny random Qwen3, synthetic pairs, CPU, seconds
    python examples/dpo_shared_prompt.py --compare      # also train trl.DPOTrainer and check the same losses

TRL's DPO runs each prompt twice (chosen and rejected rows) in the policy forward and twice in the reference
forward. `TreeDPOTrainer` packs a batch's rows into prefix forests: the system prompt once per batch, each prompt
once, in both forwards (the reference forward reuses the policy forward's packing). The loss is TRL's own code on
the same per-token tensors, so any `--loss_type` TRL offers works. With `--compare` the script exits with status 1
unless every logged loss and reward margin equals TRL's.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile

import _tiny
import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from hf_tree_attn.trainer import TreeDPOConfig, TreeDPOTrainer

SYSTEM = (
    "you are a careful math tutor. answer with the number first, then one short reason; never round, never guess, "
    "and say so when the question has no answer.\n"
)


def pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        prompt = SYSTEM + f"q: what is {a} plus {b}?\n"
        rows.append(
            {"prompt": prompt, "chosen": f"{a + b}, since {a}+{b}={a + b}.", "rejected": f"about {a + b + 1}."}
        )
    return rows


def train(trainer_cls, config_cls, path, dataset, args) -> list[dict]:
    config = config_cls(
        output_dir=f"{path}/{trainer_cls.__name__}", use_cpu=not torch.cuda.is_available(), bf16=False, seed=0,
        per_device_train_batch_size=args.batch_size, max_steps=args.steps, logging_steps=1, learning_rate=3e-3,
        report_to="none", save_strategy="no", max_length=None, loss_type=[args.loss_type],
        model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True,
    )  # fmt: skip
    trainer = trainer_cls(path, args=config, train_dataset=dataset, processing_class=_tiny.tokenizer())
    _tiny.quiet(trainer)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--loss_type", default="sigmoid", help="any of TRL's DPO loss types, e.g. ipo, apo_zero")
    parser.add_argument("--compare", action="store_true", help="also train trl.DPOTrainer; exit 1 if losses differ")
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args()

    dataset = Dataset.from_list(pairs(args.pairs))
    with tempfile.TemporaryDirectory() as path:
        _tiny.save_tiny(path)
        logs = train(TreeDPOTrainer, TreeDPOConfig, path, dataset, args)
        print(f"{len(dataset)} pairs, loss_type={args.loss_type}")
        for step, entry in enumerate(logs):
            print(
                f"step {step}: loss {entry['loss']:.4f}  margin {entry['rewards/margins']:.4f}  "
                f"tree_token_ratio {entry['tree_token_ratio']:.3f}"
            )
        if not args.compare:
            return 0
        flat = train(DPOTrainer, DPOConfig, path, dataset, args)
    diff = max(max(abs(a[k] - b[k]) for k in ("loss", "rewards/margins")) for a, b in zip(logs, flat))
    ok = len(logs) == len(flat) and diff <= args.atol
    print(f"max |tree - trl.DPOTrainer| loss / margin = {diff:.2e} (atol {args.atol:.0e}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
