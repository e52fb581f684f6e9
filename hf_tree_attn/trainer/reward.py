"""Sequence-classification reward models on packed prefix trees: a GRPO group's completions scored from one forest.

TRL's GRPO scores completions with a reward model by tokenizing every `prompt + completion` text, right-padding
the batch and calling `reward_model(input_ids, attention_mask).logits[:, 0]`: the G completions of a prompt each
run the prompt again. transformers' decoder-only `*ForSequenceClassification` models
(`transformers.modeling_layers.GenericForSequenceClassification`) apply a linear `score` head to every position and
keep, per row, the rightmost position whose token is not the pad token (the last row if the config has no pad
token, which only a batch of one allows)::

    row  [p p p a b <pad>]   ->  score(h[4])        the last token that is not pad_token_id,
    row  [p p p c <pad> .]   ->  score(h[3])        whatever the attention mask says

A causal backbone's hidden state at a token depends only on the tokens before it, so on a forest the score of a row
is `score` applied to the forest row that holds that token: `tree_reward_models` swaps such a model's forward, for
the duration of TRL's reward computation, for one that packs the batch's rows into forests, runs the backbone once
per forest and applies `score` to exactly those rows. A model outside the gate (`reward_model_error`), a batch
whose chosen token is padding, extra inputs, or too little sharing (`max_token_ratio`) score flat, as TRL does.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..attention import ATTN_IMPLEMENTATION, registration_error
from ..logprobs import forest_forward_kwargs
from ..support import (
    EXACT_FAMILIES,
    _state_layer_error,
    config_support_error,
    rope_length_limit,
    rope_split_lengths,
    unwrap_model,
)
from ..tree import pack_forest
from .forest_step import _log_once

__all__ = ["reward_model_error", "score_on_forests", "tree_reward_models"]


_SWITCHABLE_ATTN = (None, "sdpa", "eager", ATTN_IMPLEMENTATION)


def reward_model_error(model: torch.nn.Module) -> str | None:
    """Why `model` cannot score packed trees exactly (naming the way out), or None.

    The gate: transformers' generic decoder-only sequence classifier (a backbone, a plain `nn.Linear` `score` head,
    the last-non-pad-token pooling above) of a family whose backbone trees run exactly (`EXACT_FAMILIES`), within
    the config the gate accepts, on an attention implementation `tree_flex` stands in for.
    """
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    name = type(model).__name__
    fix = "It scores flat, as in trl.GRPOTrainer."
    if not isinstance(model, GenericForSequenceClassification):
        return (
            f"{name} is not transformers' generic decoder-only sequence classifier (GenericForSequenceClassification: "
            f"a backbone, a linear `score` head read at the last non-pad token), so its pooling is not known. {fix}"
        )
    mro = {cls.__name__ for cls in type(model).__mro__}
    families = [f for f, cls in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.items() if cls in mro]
    family = model.config.model_type if model.config.model_type in families else (families or [None])[0]
    if family not in EXACT_FAMILIES:
        return f"{name}'s family {family!r} is not among those trees run exactly (EXACT_FAMILIES). {fix}"
    reason = config_support_error(model.config, family) or _state_layer_error(model)
    if reason is not None:
        return f"{reason} ({name}; it scores flat, as in trl.GRPOTrainer.)"
    if type(model.score) is not torch.nn.Linear:
        return f"{name}.score is a {type(model.score).__name__}, not a plain nn.Linear. {fix}"
    impl = model.config._attn_implementation
    if impl not in _SWITCHABLE_ATTN:
        return (
            f"{name} runs attn_implementation={impl!r}, which {ATTN_IMPLEMENTATION!r} does not stand in for; load it "
            f"with 'sdpa' or {ATTN_IMPLEMENTATION!r} to score on trees. {fix}"
        )
    reason = registration_error()
    if reason is not None:
        return f"{reason} {fix}"
    return None


def score_on_forests(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_tokens_per_mb: int | None = None,
    max_token_ratio: float = 1.0,
) -> tuple[torch.Tensor | None, str | None, float]:
    """`model`'s pooled logits of right-padded rows, from packed forests.

    Args:
        model: a reward model `reward_model_error` accepts, on `tree_flex`.
        input_ids, attention_mask: `(N, L)`, right-padded (as TRL's reward tokenization pads).
        max_tokens_per_mb: token budget of one forest (raised to the longest row if that is longer).
        max_token_ratio: score flat when the forests hold more than this fraction of `N * L`.

    Returns:
        `(logits (N, num_labels), None, ratio)`, or `(None, reason, ratio)` when the batch must score flat; `ratio` is
        forest rows / `N * L` (nan when not packed).
    """
    ids = input_ids.detach().cpu()
    mask = attention_mask.detach().cpu().bool()
    rows, width = ids.shape
    lengths = mask.sum(1)
    if not torch.equal(mask, torch.arange(width) < lengths[:, None]) or bool((lengths == 0).any()):
        return None, "the rows are not right-padded", float("nan")
    pad = model.config.get_text_config().pad_token_id
    if pad is None and rows > 1:
        return None, "the config has no pad token (transformers refuses such a batch)", float("nan")
    # Without a pad token transformers reads the last position (a batch of one): real only if unpadded.
    last = torch.full((rows,), width - 1) if pad is None else (torch.arange(width) * (ids != pad)).argmax(-1)
    if not bool((last < lengths).all()):
        return None, "the token the model scores is padding in some row", float("nan")
    limit = rope_length_limit(model.config)
    if limit is not None and int(lengths.max()) > limit:
        return None, f"a row is longer than the {limit} tokens this model's dynamic RoPE keeps exact", float("nan")
    sequences = [ids[r, : lengths[r]] for r in range(rows)]
    budget = max_tokens_per_mb
    if budget is not None and int(lengths.max()) > budget:
        budget = -(-int(lengths.max()) // 128) * 128
    forests = pack_forest(sequences, max_tokens_per_mb=budget, split_lengths=rope_split_lengths(model.config))
    ratio = sum(f.num_tree_tokens for f in forests) / ids.numel()
    if ratio > max_token_ratio:
        return None, f"ratio {ratio:.3f} > max_token_ratio {max_token_ratio}", ratio

    device = model.get_input_embeddings().weight.device
    backbone = getattr(model, model.base_model_prefix)
    pooled = [None] * rows
    for forest in forests:
        forest = forest.to(device)
        hidden = backbone(**forest_forward_kwargs(forest, device)).last_hidden_state[0]  # (S, hidden)
        offsets = forest.seq_offsets.tolist()
        picked = torch.tensor([offsets[k] + int(last[r]) for k, r in enumerate(forest.seq_ids)], device=device)
        logits = model.score(hidden[forest.seq_positions.to(device)[picked]])  # (n, num_labels)
        for k, r in enumerate(forest.seq_ids):
            pooled[r] = logits[k]
    return torch.stack(pooled), None, ratio


@contextlib.contextmanager
def tree_reward_models(
    reward_funcs: Sequence,
    max_tokens_per_mb: int | None = None,
    max_token_ratio: float = 0.9,
    record: Callable[[str, float], None] | None = None,
):
    """Within the block, every reward model of `reward_funcs` the gate accepts scores on packed forests.

    Each accepted model runs `tree_flex` (switched from `sdpa` / `eager` and back) and a forward that calls
    `score_on_forests` for TRL's `(input_ids, attention_mask)` call and its own forward for anything else. Refused
    models keep their forward; the reason is logged once. `record(name, value)` gets `reward_tree_fallback`
    (0 / 1 per accepted model call) and `reward_tree_compute_ratio`.
    """
    record = record or (lambda name, value: None)
    swapped = []
    try:
        for func in reward_funcs:
            if not isinstance(func, torch.nn.Module):
                continue
            model = unwrap_model(func)
            reason = reward_model_error(model)
            if reason is not None:
                _log_once(logging.WARNING, f"Reward model {type(model).__name__}: {reason}", __name__)
                continue
            impl = model.config._attn_implementation
            if impl != ATTN_IMPLEMENTATION:
                model.set_attn_implementation(ATTN_IMPLEMENTATION)
            swapped.append((model, model.__dict__.get("forward"), impl))
            model.forward = types.MethodType(
                _tree_forward(model.forward, max_tokens_per_mb, max_token_ratio, record), model
            )
        yield
    finally:
        for model, forward, impl in swapped:
            if forward is None:
                del model.forward
            else:
                model.forward = forward
            if impl != ATTN_IMPLEMENTATION:
                model.set_attn_implementation(impl or "sdpa")


def _tree_forward(stock_forward, max_tokens_per_mb, max_token_ratio, record):
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    def forward(self, input_ids=None, attention_mask=None, *args, **kwargs):
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in ("use_cache", "return_dict"))
        if args or extra or input_ids is None or attention_mask is None or input_ids.ndim != 2:
            reason = f"the call passes inputs the tree does not lay out ({extra or 'positional'})"
            logits, ratio = None, float("nan")
        else:
            logits, reason, ratio = score_on_forests(
                self, input_ids, attention_mask, max_tokens_per_mb, max_token_ratio
            )
        record("reward_tree_fallback", float(logits is None))
        if not np.isnan(ratio):
            record("reward_tree_compute_ratio", ratio)
        if logits is None:
            _log_once(logging.INFO, f"A reward-model batch scores flat: {reason}.", __name__)
            return stock_forward(input_ids, attention_mask, *args, **kwargs)
        return SequenceClassifierOutputWithPast(logits=logits)

    return forward
