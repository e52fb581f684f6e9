"""The embedded default of `trainers/grpo_tree.py`: a task, tokenizer and model that need no download.

- **Tokenizer**: character level, built in code with `tokenizers` (left padding, `<eos>`), saved like any other.
- **Model**: a tiny Qwen3 (2 layers, hidden 64) from a config, `attn_implementation="tree_flex"`; or, with
  `--embedded_model qwen3_5`, a tiny Qwen3.5 hybrid (a Gated DeltaNet layer, then full attention).
- **Task** ("copy the letter"): every prompt starts with the same long system prompt (so a micro-batch shares it,
  plus each prompt with its `num_generations` completions), then an id and a line ``letter <x>=``. The completion
  should repeat ``<x>``; the reward is the fraction of completion characters equal to ``<x>``. A random model
  scores about 1/vocab; it first learns to emit letters of the task alphabet, then to copy the one before ``=``.
"""

from __future__ import annotations

import copy
import random
import string
from dataclasses import dataclass, field

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3_5TextConfig,
    Qwen3Config,
)

import hf_tree_attn

__all__ = [
    "EMBEDDED_MODELS",
    "LETTERS",
    "EmbeddedTaskArguments",
    "SYSTEM_PROMPT",
    "build_dataset",
    "build_model",
    "build_tokenizer",
    "copy_letter_reward",
    "model_config",
]

CHARS = string.ascii_lowercase + string.digits + " .,:;=>?!-'\n"
LETTERS = "abcd"
SYSTEM_PROMPT = (
    "You are a careful assistant that follows the rules of this game exactly. Read the id and then the last "
    "line of the request. The last line names one letter right before the equals sign. Answer with that "
    "letter, repeated if you like, and with nothing else: no spaces, no digits, no words.\n"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: `<pad>`=0, `<eos>`=1, `<unk>`=2, then one id per character of `CHARS`."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


EMBEDDED_MODELS = ("qwen3", "qwen3_5")


@dataclass
class EmbeddedTaskArguments:
    """Options of the embedded default task (used only when no `--model_name_or_path` is given)."""

    embedded_model: str = field(
        default="qwen3",
        metadata={
            "help": "Tiny model the embedded task trains: 'qwen3' (dense) or 'qwen3_5' (hybrid: Gated DeltaNet + full "
            "attention, whose recurrent state the tree forks at branch points).",
            "choices": list(EMBEDDED_MODELS),
        },
    )


def model_config(tokenizer: PreTrainedTokenizerFast, model_type: str = "qwen3", **overrides) -> PretrainedConfig:
    """A tiny config sized to `tokenizer`: Qwen3 (2 layers, hidden 64, GQA 4/2 heads of 16) or Qwen3.5 (the same
    attention layer after a Gated DeltaNet layer with 4 value / 2 key heads of 16 and a 4-tap conv)."""
    if model_type not in EMBEDDED_MODELS:
        raise ValueError(f"model_type={model_type!r} is not an embedded model; use one of {EMBEDDED_MODELS}.")
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3_5":
        kwargs.update(
            layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        )  # fmt: skip
    kwargs.update(overrides)
    return (Qwen3_5TextConfig if model_type == "qwen3_5" else Qwen3Config)(**kwargs)


def build_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, model_type: str = "qwen3", **overrides
) -> PreTrainedModel:
    """A freshly initialised tiny `model_type` model (see `model_config`) with `attn_implementation="tree_flex"`
    (seeded)."""
    import torch

    torch.manual_seed(seed)
    config = copy.deepcopy(model_config(tokenizer, model_type, **overrides))  # from_config mutates its config
    model = AutoModelForCausalLM.from_config(config, attn_implementation=hf_tree_attn.ATTN_IMPLEMENTATION)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_dataset(num_prompts: int = 2048, seed: int = 0):
    """`datasets.Dataset` with `prompt` (shared system prompt + id + ``letter <x>=``) and `target` (``<x>``)."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts, targets = [], []
    for _ in range(num_prompts):
        target = rng.choice(LETTERS)
        uid = "".join(rng.choice(string.digits) for _ in range(6))
        prompts.append(f"{SYSTEM_PROMPT}id {uid}.\nletter: {target}")
        targets.append(target)
    return Dataset.from_dict({"prompt": prompts, "target": targets})


def copy_letter_reward(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """Fraction of the completion's characters that equal the prompt's letter (0 for an empty completion)."""
    return [sum(ch == t for ch in c) / len(c) if c else 0.0 for c, t in zip(completions, target)]
