"""How much a tree saves: unique-token ratio and a forward-FLOPs estimate for a model config.

The FLOP model is written out, with its public sources, in docs/how_it_works.md ("The FLOP model"): forward
FLOPs only (the backward pass costs about twice the forward for every term, so the tree / flat ratio is the same),
counted as per-token linear work, attention over the (query, key) pairs each layer really computes — every earlier
token for a full layer, at most `sliding_window` of them for a sliding-window layer, the tokens of the same chunk
for a chunked one — and the LM head on the scored tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .tree import TokenSequence, _as_array, _check_not_tensor, _sorted_with_lcp

__all__ = ["estimate_flops"]


def estimate_flops(config, sequences: Sequence[TokenSequence], prompt_lengths: Sequence[int] | None = None) -> dict:
    """Forward FLOPs of scoring `sequences` flat (one row each) and as one prefix forest.

    Args:
        config: a transformers decoder config (`hidden_size`, `num_hidden_layers`, `intermediate_size`,
            `num_attention_heads`, `num_key_value_heads`, `head_dim`, `vocab_size`; `layer_types`,
            `sliding_window`, `attention_chunk_size` where the model has them).
        sequences: token-id sequences.
        prompt_lengths: tokens at depth below `prompt_lengths[i]` are not scored (as TRL's `logits_to_keep`);
            default scores every token after the first.

    Returns:
        `{"flat_flops", "tree_flops", "flops_ratio" (tree / flat), "flops_saved" (1 - ratio), "token_ratio"}`.
    """
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    linear = 2 * layers * (2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 3 * d * config.intermediate_size)
    attn_pair = 4 * heads * head_dim  # QK^T and PV for one (query, key) pair in one layer
    head = 2 * d * vocab
    spans = _attention_spans(config)

    _check_not_tensor(sequences)
    arrays = [_as_array(s, i) for i, s in enumerate(sequences)]
    if not arrays:
        raise ValueError("sequences is empty; pass at least one token sequence.")
    if prompt_lengths is not None and len(prompt_lengths) != len(arrays):
        raise ValueError(
            f"prompt_lengths has {len(prompt_lengths)} entries for {len(arrays)} sequences; pass one per sequence."
        )
    order, lcp = _sorted_with_lcp(arrays)
    lengths = np.array([len(arrays[i]) for i in order], dtype=np.int64)
    first_scored = (
        np.ones_like(lengths) if prompt_lengths is None else np.maximum(np.asarray(prompt_lengths)[order], 1)
    )

    flat_tokens = int(lengths.sum())
    flat_depths = np.concatenate([np.arange(n) for n in lengths])
    flat_scored = int(np.maximum(lengths - first_scored, 0).sum())
    # Tree: each sequence adds depths lcp..L-1; a row at depth t attends to t + 1 ancestors-or-self. The LM head
    # runs once per scored tree token (TRL's fused kernel, the default head, takes one row per target), scored if
    # any sequence through it scores it. Flags on the current DFS path mark tokens already counted; a sorted
    # sequence shares its first lcp rows with the previous one and inherits their flags (prompt lengths may differ
    # between sequences that share rows).
    tree_tokens = int((lengths - lcp).sum())
    tree_depths = np.concatenate([np.arange(k, n) for k, n in zip(lcp.tolist(), lengths.tolist())])
    tree_scored, scored_path = 0, np.zeros(0, dtype=bool)
    for keep, length, first in zip(lcp.tolist(), lengths.tolist(), first_scored.tolist()):
        scored_path = np.concatenate([scored_path[:keep], np.zeros(length - keep, dtype=bool)])
        tree_scored += int((~scored_path[first:length]).sum())
        scored_path[first:length] = True

    flat = flat_tokens * linear + _pairs(flat_depths, spans) * attn_pair + flat_scored * head
    tree = tree_tokens * linear + _pairs(tree_depths, spans) * attn_pair + tree_scored * head
    return {
        "flat_flops": float(flat),
        "tree_flops": float(tree),
        "flops_ratio": tree / flat,
        "flops_saved": 1.0 - tree / flat,
        "token_ratio": tree_tokens / flat_tokens,
    }


def _attention_spans(config) -> list[tuple[str, int | None]]:
    """Per layer: ("full", None), ("window", W) or ("chunk", C), from `layer_types` and the window fields."""
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    kinds = getattr(config, "layer_types", None)
    if not kinds:  # no per-layer kinds (Mistral, Mixtral, Phi-3, …): the window, if any, is on every layer
        kinds = ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers
    spans = []
    for kind in kinds[: config.num_hidden_layers]:
        if kind == "sliding_attention" and window:
            spans.append(("window", int(window)))
        elif kind == "chunked_attention" and chunk:
            spans.append(("chunk", int(chunk)))
        else:
            spans.append(("full", None))
    return spans


def _pairs(depths: np.ndarray, spans: list[tuple[str, int | None]]) -> int:
    """(query, key) pairs summed over layers for queries at `depths` (a query at depth t sees its t + 1 ancestors-or-
    self, at most W of them in a window, those of its own chunk in a chunked layer)."""
    seen = {
        "full": lambda size: depths + 1,
        "window": lambda size: np.minimum(depths + 1, size),
        "chunk": lambda size: depths % size + 1,
    }
    return int(sum(int(seen[kind](size).sum()) for kind, size in spans))
