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
per forest and applies `score` to exactly those rows; `TreeRewardTrainer` swaps its model's forward the same way
(`forest_scoring`) for each of TRL's loss computations. A model outside the gate (`reward_model_error`), a batch
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
from ..hidden_states import forest_hidden_states
from ..support import (
    EXACT_FAMILIES,
    _state_layer_error,
    config_support_error,
    peft_config_error,
    rope_length_limit,
    rope_split_lengths,
    unwrap_model,
)
from ..tree import pack_forest
from .forest_step import _log_once

__all__ = ["forest_scoring", "reward_model_error", "score_on_forests", "scoring_model", "tree_reward_models"]


_SWITCHABLE_ATTN = (None, "sdpa", "eager", ATTN_IMPLEMENTATION)
_GRPO_FALLBACK = "It scores flat, as in trl.GRPOTrainer."


def scoring_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers sequence classifier inside DDP-style and PEFT wrappers: the module whose forward the tree
    replaces (a PEFT model's forward calls it with the adapters injected into its layers)."""
    model = unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _row_wise_score(score: torch.nn.Module) -> bool:
    """Whether `score` may be applied to the picked rows alone: it maps each row on its own, as a plain `nn.Linear`
    does, or PEFT's `modules_to_save` wrapper (which runs the active adapter's copy, or the original) around plain
    `nn.Linear`s."""
    copies = [score.original_module, *score.modules_to_save.values()] if hasattr(score, "modules_to_save") else [score]
    return all(type(m) is torch.nn.Linear for m in copies)


def reward_model_error(model: torch.nn.Module, fallback: str = _GRPO_FALLBACK) -> str | None:
    """Why `model` cannot score packed trees exactly (naming the way out), or None.

    The gate: transformers' generic decoder-only sequence classifier (a backbone, a plain `nn.Linear` `score` head,
    the last-non-pad-token pooling above) of a family whose backbone trees run exactly (`EXACT_FAMILIES`), within
    the config the gate accepts, on an attention implementation `tree_flex` stands in for; inside DDP-style
    wrappers and PEFT (a LoRA-style adapter; `modules_to_save=["score"]`, which PEFT's sequence-classification task
    sets, keeps the head exact). `fallback` ends each reason: what the caller does instead.
    """
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    reason = peft_config_error(getattr(unwrap_model(model), "active_peft_config", None))
    if reason is not None:
        return f"{reason} {fallback}".strip()
    model = scoring_model(model)
    name = type(model).__name__
    fix = fallback
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
        return f"{reason} ({name}) {fix}".strip()
    if not _row_wise_score(model.score):
        return (
            f"{name}.score is a {type(model.score).__name__}, not a plain nn.Linear (nor PEFT's modules_to_save copy "
            "of one), so scoring only the picked rows is not known to be exact (a LoRA on `score`: leave it out of "
            f"target_modules; modules_to_save=['score'] trains it exactly). {fix}"
        ).strip()
    impl = model.config._attn_implementation
    if impl not in _SWITCHABLE_ATTN:
        return (
            f"{name} runs attn_implementation={impl!r}, which {ATTN_IMPLEMENTATION!r} does not stand in for; load it "
            f"with 'sdpa' or {ATTN_IMPLEMENTATION!r} to score on trees. {fix}"
        ).strip()
    reason = registration_error()
    if reason is not None:
        return f"{reason} {fix}".strip()
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
        model: a reward model `reward_model_error` accepts, on `tree_flex` (the sequence classifier itself:
            `scoring_model`).
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
    # The backbone, not `model`: this runs inside `model`'s own (swapped) forward.
    backbone = model.base_model
    pooled = [None] * rows
    for forest in forests:
        forest = forest.to(device)
        hidden = forest_hidden_states(backbone, forest)  # (S, hidden)
        offsets = forest.seq_offsets.tolist()
        picked = torch.tensor([offsets[k] + int(last[r]) for k, r in enumerate(forest.seq_ids)], device=device)
        logits = model.score(hidden[forest.seq_positions.to(device)[picked]])  # (n, num_labels)
        for k, r in enumerate(forest.seq_ids):
            pooled[r] = logits[k]
    return torch.stack(pooled), None, ratio


@contextlib.contextmanager
def forest_scoring(
    model: torch.nn.Module,
    max_tokens_per_mb: int | None = None,
    max_token_ratio: float = 0.9,
    record: Callable[[str, float], None] | None = None,
    ignored: Sequence[str] = (),
):
    """Within the block, `model` (a sequence classifier the gate accepts, on `tree_flex`: `scoring_model`) scores a
    call `(input_ids, attention_mask)` of right-padded rows on packed forests (`score_on_forests`), and anything else,
    or a batch the tree cannot lay out, with its own forward.

    `record(name, value)` gets `tree_fallback` (0 / 1 per call) and `tree_compute_ratio`. `ignored` names inputs
    the caller passes that the model's forward hands down unread (TRL's reward trainer passes its whole batch,
    `margin` included); any other input the tree does not lay out scores flat.
    """
    record = record or (lambda name, value: None)
    forward = model.__dict__.get("forward")
    model.forward = types.MethodType(
        _tree_forward(model.forward, max_tokens_per_mb, max_token_ratio, record, frozenset(ignored)), model
    )
    try:
        yield
    finally:
        if forward is None:
            del model.forward
        else:
            model.forward = forward


@contextlib.contextmanager
def tree_reward_models(
    reward_funcs: Sequence,
    max_tokens_per_mb: int | None = None,
    max_token_ratio: float = 0.9,
    record: Callable[[str, float], None] | None = None,
):
    """Within the block, every reward model of `reward_funcs` the gate accepts scores on packed forests.

    Each accepted model runs `tree_flex` (switched from `sdpa` / `eager` and back) and a forward that calls
    `score_on_forests` for TRL's `(input_ids, attention_mask)` call and its own forward for anything else
    (`forest_scoring`). Refused models keep their forward; the reason is logged once. `record(name, value)` gets
    `reward_tree_fallback` (0 / 1 per accepted model call) and `reward_tree_compute_ratio`.
    """
    record = record or (lambda name, value: None)
    switched = []
    with contextlib.ExitStack() as stack:
        try:
            for func in reward_funcs:
                if not isinstance(func, torch.nn.Module):
                    continue
                reason = reward_model_error(func)
                if reason is not None:
                    _log_once(logging.WARNING, f"Reward model {type(func).__name__}: {reason}", __name__)
                    continue
                model = scoring_model(func)
                impl = model.config._attn_implementation
                if impl != ATTN_IMPLEMENTATION:
                    model.set_attn_implementation(ATTN_IMPLEMENTATION)
                    switched.append((model, impl))
                stack.enter_context(
                    forest_scoring(
                        model, max_tokens_per_mb, max_token_ratio, lambda name, value: record(f"reward_{name}", value)
                    )
                )
            yield
        finally:
            for model, impl in switched:
                model.set_attn_implementation(impl or "sdpa")


def _tree_forward(stock_forward, max_tokens_per_mb, max_token_ratio, record, ignored):
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    def forward(self, input_ids=None, attention_mask=None, *args, **kwargs):
        unread = ignored | {"use_cache", "return_dict"}
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in unread)
        if args or extra or input_ids is None or attention_mask is None or input_ids.ndim != 2:
            reason = f"the call passes inputs the tree does not lay out ({extra or 'positional'})"
            logits, ratio = None, float("nan")
        else:
            logits, reason, ratio = score_on_forests(
                self, input_ids, attention_mask, max_tokens_per_mb, max_token_ratio
            )
        record("tree_fallback", float(logits is None))
        if not np.isnan(ratio):
            record("tree_compute_ratio", ratio)
        if logits is None:
            _log_once(logging.INFO, f"A reward-model batch scores flat: {reason}.", __name__)
            return stock_forward(input_ids, attention_mask, *args, **kwargs)
        return SequenceClassifierOutputWithPast(logits=logits)

    return forward
