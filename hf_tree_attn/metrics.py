"""How much a tree saves: unique-token ratio and a forward-FLOPs estimate for a model config.

The FLOP model is written out, with its public sources, in docs/how_it_works.md ("The FLOP model"): forward
FLOPs only (the backward pass costs about twice the forward for every term, so the tree / flat ratio is the same),
counted as per-token linear work, attention over the (query, key) pairs each layer really computes — every earlier
token for a full layer, at most `sliding_window` of them for a sliding-window layer, the tokens of the same chunk
for a chunked one, none for a state-carrying layer (Gated DeltaNet in Qwen3.5 / Qwen3-Next: its projections, short
convolution and chunked delta-rule scan are per-token work) — and the LM head on the scored tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .tree import TokenSequence, _as_array, _check_not_tensor, _sorted_with_lcp

__all__ = ["estimate_flops"]


_GDN_CHUNK = (
    64  # chunk length of the chunked delta-rule kernels (flash-linear-attention's and transformers' torch one)
)


def _layer_costs(config) -> tuple[int, int]:
    """`(per_token, per_pair)`: forward FLOPs of all decoder layers per token (projections, MLP, recurrent scans),
    and of one attended (query, key) pair (QK^T and PV) in one attention layer (`_attention_spans` says which layers
    attend to how many keys)."""
    d = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    mlp = 3 * d * config.intermediate_size
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    # Gated DeltaNet layers are counted exactly below; other state-carrying layers (short convs, Mamba-2, Kimi's
    # delta rule) are estimated as attention layers' projections without (query, key) pairs.
    gdn = [t for t in layer_types if t == "linear_attention"] if hasattr(config, "linear_num_value_heads") else []
    # Qwen3.5 / Qwen3-Next attention also projects a sigmoid output gate with q_proj (twice its width).
    gated = getattr(config, "model_type", "") in ("qwen3_5_text", "qwen3_next")
    attention = (2 + gated) * d * heads * head_dim + 2 * d * kv_heads * head_dim + mlp
    per_token = 2 * (len(layer_types) - len(gdn)) * attention
    per_pair = 4 * heads * head_dim
    if gdn:
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        projections = d * conv_dim + d * v_heads * v_dim + 2 * d * v_heads + v_heads * v_dim * d + mlp  # qkv z b a o
        conv = config.linear_conv_kernel_dim * conv_dim
        # Chunked delta rule per head: in-chunk q·k, k·k and attention·v products, the triangular solve, and three
        # (k_dim x v_dim) state reads / updates per token.
        scan = v_heads * (_GDN_CHUNK * (2 * k_dim + v_dim) + _GDN_CHUNK * (k_dim + v_dim) // 2 + 3 * k_dim * v_dim)
        per_token += 2 * len(gdn) * (projections + conv + scan)
    return per_token, per_pair


def estimate_flops(config, sequences: Sequence[TokenSequence], prompt_lengths: Sequence[int] | None = None) -> dict:
    """Forward FLOPs of scoring `sequences` flat (one row each) and as one prefix forest.

    Args:
        config: a transformers decoder config (`hidden_size`, `num_hidden_layers`, `intermediate_size`,
            `num_attention_heads`, `num_key_value_heads`, `head_dim`, `vocab_size`; `layer_types`,
            `sliding_window`, `attention_chunk_size` where the model has them, and the `linear_*` fields of Gated
            DeltaNet hybrids).
        sequences: token-id sequences.
        prompt_lengths: tokens at depth below `prompt_lengths[i]` are not scored (as TRL's `logits_to_keep`);
            default scores every token after the first.

    Returns:
        `{"flat_flops", "tree_flops", "flops_ratio" (tree / flat), "flops_saved" (1 - ratio), "token_ratio"}`.
    """
    linear, attn_pair = _layer_costs(config)
    head = 2 * config.hidden_size * config.vocab_size
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


_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "attention", "hybrid")


def _attention_spans(config) -> list[tuple[str, int | None]]:
    """Per layer: ("full", None), ("window", W) or ("chunk", C), from `layer_types` and the window fields."""
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    kinds = getattr(config, "layer_types", None)
    if not kinds:  # no per-layer kinds (Mistral, Mixtral, Phi-3, …): the window, if any, is on every layer
        kinds = ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers
    spans = []
    for kind in kinds[: config.num_hidden_layers]:
        if kind not in _ATTENTION_KINDS:
            continue  # a state-carrying or MLP-only layer attends to no keys
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
