"""What the trainer examples share: a character tokenizer with a chat template and a tiny random Qwen3, built in
code (no download), saved to a folder so TRL loads them as it loads any checkpoint."""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast, Qwen3Config

CHARS = string.ascii_lowercase + string.digits + " .,:;=>?!-'()\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] + ': ' + m['content'] }}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}"
)


def quiet(trainer) -> None:
    """No progress bars or per-step dicts: the examples print what they measure themselves."""
    import datasets
    import transformers
    from transformers.trainer_callback import PrinterCallback

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    trainer.remove_callback(PrinterCallback)


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def config(tok, **overrides) -> Qwen3Config:
    kwargs = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3Config(**{**kwargs, **overrides})


def save_tiny(path: str, seed: int = 0, reward_model: bool = False) -> str:
    """A random tiny Qwen3 causal LM (or, with `reward_model`, a 1-label sequence classifier) and the tokenizer."""
    tok = tokenizer()
    torch.manual_seed(seed)
    if reward_model:
        model = AutoModelForSequenceClassification.from_config(config(tok, num_labels=1))
    else:
        model = AutoModelForCausalLM.from_config(config(tok))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
