"""SFT on agent trajectories stored one sample per assistant turn, with `TreeSFTTrainer`.

    python examples/sft_agent_turns.py                  # tiny random Qwen3, synthetic trajectories, CPU, seconds
    python examples/sft_agent_turns.py --compare        # also train trl.SFTTrainer and check the same losses

Each sample is a conversational prompt-completion pair: the prompt is the whole conversation before an assistant
turn (a long system prompt with tool descriptions, then the user / assistant / tool turns so far), the completion
is that turn. TRL prepares the dataset exactly as for `trl.SFTTrainer` (chat template, completion-only loss); a
batch of consecutive samples shares the system prompt and the history, which the tree computes once. The log's
`tree_token_ratio` is forest rows / real tokens. With `--compare` the script exits with status 1 unless every
logged loss equals TRL's.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile

import _tiny
import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from hf_tree_attn.trainer import TreeSFTConfig, TreeSFTTrainer

SYSTEM = (
    "you are a shell agent. tools: ls(dir), cat(file), grep(word, file), answer(text). call exactly one tool per "
    "turn, keep thoughts short, never guess a file name, and answer only once you have read the file.\n"
)
WORDS = ["alpha", "beta", "notes", "todo", "src", "docs", "main", "data", "config", "log"]


def trajectories(n: int, turns: int, seed: int = 0) -> list[dict]:
    """`n` conversations of `turns` tool calls, as one prompt-completion sample per assistant turn."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"what does {rng.choice(WORDS)} say?"},
        ]
        for _ in range(turns):
            call = f"{rng.choice(['ls', 'cat', 'grep'])}({rng.choice(WORDS)}/{rng.choice(WORDS)})"
            samples.append({"prompt": list(messages), "completion": [{"role": "assistant", "content": call}]})
            messages += [
                {"role": "assistant", "content": call},
                {"role": "tool", "content": " ".join(rng.choices(WORDS, k=6))},
            ]
    return samples


def train(trainer_cls, config_cls, path, dataset, args) -> list[dict]:
    config = config_cls(
        output_dir=f"{path}/{trainer_cls.__name__}", use_cpu=not torch.cuda.is_available(), bf16=False, seed=0,
        per_device_train_batch_size=args.batch_size, max_steps=args.steps, logging_steps=1, learning_rate=3e-3,
        report_to="none", save_strategy="no", max_length=None, train_sampling_strategy="sequential",
        model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True,
    )  # fmt: skip
    trainer = trainer_cls(path, args=config, train_dataset=dataset, processing_class=_tiny.tokenizer())
    _tiny.quiet(trainer)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--compare", action="store_true", help="also train trl.SFTTrainer; exit 1 if losses differ")
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args()

    dataset = Dataset.from_list(trajectories(args.conversations, args.turns))
    with tempfile.TemporaryDirectory() as path:
        _tiny.save_tiny(path)
        logs = train(TreeSFTTrainer, TreeSFTConfig, path, dataset, args)
        print(f"{len(dataset)} per-turn samples ({args.conversations} conversations x {args.turns} turns)")
        for step, entry in enumerate(logs):
            print(f"step {step}: loss {entry['loss']:.4f}  tree_token_ratio {entry['tree_token_ratio']:.3f}")
        if not args.compare:
            return 0
        flat = train(SFTTrainer, SFTConfig, path, dataset, args)
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(logs, flat))
    ok = len(logs) == len(flat) and diff <= args.atol
    print(f"max |tree - trl.SFTTrainer| loss = {diff:.2e} (atol {args.atol:.0e}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
