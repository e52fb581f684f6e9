"""The last hidden states of a packed forest's rows: what a value head (a PPO critic) or a reward head reads.

A decoder's hidden state at a token depends only on that token and the tokens before it, so the hidden state of a
forest row is the one that token has in a flat forward of every sequence passing through the row. A head applied
row by row (a value per token, a reward score at a chosen token) therefore gives each sequence's flat values, with
every shared row computed once; under autograd the gradients of a shared row are summed over the sequences that
read it, which is the flat gradient.

    hidden = forest_hidden_states(model, forest)            # (S, hidden)
    values = value_head(hidden).squeeze(-1)                  # (S,): one value per row
    per_sequence = gather_hidden_states(forest, values)      # [(L_k,) for k in packed order]
"""

from __future__ import annotations

import torch

from .compile import call_compiled
from .logprobs import _final_hidden_states, forest_forward_kwargs
from .model_inputs import check_forest_inputs
from .support import unwrap_model
from .tree import PackedForest

__all__ = ["forest_hidden_states", "gather_hidden_states"]


def _is_backbone(model: torch.nn.Module) -> bool:
    """Whether `model` (through DDP / DeepSpeed / PEFT wrappers) is a bare transformers backbone (`Qwen3Model`), which
    has no head for `_final_hidden_states` to make a no-op and returns `last_hidden_state` itself."""
    from transformers import PreTrainedModel

    inner = unwrap_model(model)
    if hasattr(inner, "get_base_model"):  # PEFT
        inner = inner.get_base_model()
    return isinstance(inner, PreTrainedModel) and inner.base_model is inner


def forest_hidden_states(model: torch.nn.Module, forest: PackedForest) -> torch.Tensor:
    """The final hidden states (after the decoder's last norm, before any head) of every row of `forest`.

    Args:
        model: a model loaded with `attn_implementation="tree_flex"`: a causal LM, a decoder-only
            `*ForSequenceClassification` model, or a bare backbone (`AutoModel`); PEFT, FSDP2 and DDP wrappers are
            fine. The module given is the one called (its hooks and wrappers run) and its own output is discarded:
            a causal LM's LM head runs on no row (an empty `logits_to_keep`), a classifier's `num_labels`-wide
            `score` is cheap.
        forest: the micro-batch, on the model's device.

    Returns:
        `(S, hidden)` in the backbone's dtype, indexed by forest row, differentiable. Rows from `num_tree_tokens` on
        are padding: their values are not any sequence's and must not be read. `gather_hidden_states` picks each
        packed sequence's rows.
    """
    check_forest_inputs(unwrap_model(model), forest, temperature=1.0)  # no logits here: 1.0 passes that check
    inputs = forest_forward_kwargs(forest, forest.input_ids.device)
    if _is_backbone(model):
        hidden = call_compiled(model, lambda: model(**inputs)).last_hidden_state
    else:
        hidden, _ = _final_hidden_states(model, inputs)
    return hidden[0]


def gather_hidden_states(forest: PackedForest, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Each packed sequence's rows of a per-row tensor.

    Args:
        forest: the forest `hidden` was computed on.
        hidden: `(S, ...)` indexed by forest row: `forest_hidden_states`' output, or a head's output on it (values
            `(S,)`, scores `(S, num_labels)`).

    Returns:
        `[hidden[forest.positions(k)] for k]`: `(L_k, ...)` for the `k`-th packed sequence, in the packed order
        (the `k`-th entry belongs to `sequences[forest.seq_ids[k]]`), every token from the first. Differentiable.
    """
    positions = forest.seq_positions.to(hidden.device)
    offsets = forest.seq_offsets.tolist()
    return [hidden[positions[offsets[k] : offsets[k + 1]]] for k in range(len(forest.seq_ids))]
