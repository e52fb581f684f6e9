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

from .support import config_field
from .tree import TokenSequence, _as_array, _check_not_tensor, _sorted_with_lcp

__all__ = ["estimate_flops", "estimate_row_flops"]


_GDN_CHUNK = (
    64  # chunk length of the chunked delta-rule kernels (flash-linear-attention's and transformers' torch one)
)


def _layer_configs(config) -> list:
    """One config per decoder layer: `per_layer_config` where the model has one (Gemma 4), else the config itself."""
    per_layer = config_field(config, "per_layer_config")
    n = config.num_hidden_layers
    return [per_layer[i] for i in range(n)] if per_layer is not None else [config] * n


def _mlp_width(config) -> int:
    """Active MLP width per token: `intermediate_size` (GPT-2's `n_inner`, 4x hidden when unset; OPT's `ffn_dim`;
    DBRX's `ffn_config`); mixture-of-experts layers count `top_k` experts plus the shared ones. An estimate: a gated
    MLP (three matrices) is assumed everywhere."""
    top_k = config_field(config, "num_experts_per_tok", "moe_topk", "top_k", default=1)
    moe = config_field(config, "moe_intermediate_size", "expert_ffn_hidden_size")
    if moe:
        shared = config_field(config, "shared_expert_intermediate_size", default=0) or (
            config_field(config, "n_shared_experts", default=0) * moe
        )
        return top_k * moe + shared
    width = config_field(config, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
    ffn = config_field(config, "ffn_config")
    if width is None and ffn is not None:  # DBRX
        width, top_k = config_field(ffn, "ffn_hidden_size"), config_field(ffn, "moe_top_k", default=top_k)
    width = max(width) if isinstance(width, (list, tuple)) else (width or 4 * config.hidden_size)
    experts = config_field(config, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    return width * (top_k if experts else 1)


def _layer_costs(config) -> tuple[int, list[int]]:
    """`(per_token, per_pair)`: forward FLOPs of all decoder layers per token (projections, MLP, recurrent scans),
    and, per attention layer (in `_attention_spans`' order), of one attended (query, key) pair (QK^T and PV)."""
    d = config.hidden_size
    layer_types = list(config_field(config, "layer_types") or ["full_attention"] * config.num_hidden_layers)
    # Gated DeltaNet layers are counted exactly below; other state-carrying layers (short convs, Mamba-2, Kimi's
    # delta rule) are estimated as attention layers' projections without (query, key) pairs.
    gdn = hasattr(config, "linear_num_value_heads")
    # Qwen3.5 / Qwen3-Next attention also projects a sigmoid output gate with q_proj (twice its width).
    gated = getattr(config, "model_type", "") in ("qwen3_5_text", "qwen3_next")
    mlp = 3 * d * _mlp_width(config)
    per_token, per_pair, gdn_layers = 0, [], 0
    for kind, layer in zip(layer_types, _layer_configs(config)):
        if gdn and kind == "linear_attention":
            gdn_layers += 1
            continue
        heads = config_field(layer, "num_attention_heads", default=1)
        kv_heads = config_field(layer, "num_key_value_heads", default=heads)
        head_dim = config_field(layer, "head_dim", default=d // heads)
        per_token += 2 * ((2 + gated) * d * heads * head_dim + 2 * d * kv_heads * head_dim + mlp)
        if kind in _ATTENTION_KINDS:
            per_pair.append(4 * heads * head_dim)
    if gdn_layers:
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        projections = d * conv_dim + d * v_heads * v_dim + 2 * d * v_heads + v_heads * v_dim * d + mlp  # qkv z b a o
        conv = config.linear_conv_kernel_dim * conv_dim
        # Chunked delta rule per head: in-chunk q·k, k·k and attention·v products, the triangular solve, and three
        # (k_dim x v_dim) state reads / updates per token.
        scan = v_heads * (_GDN_CHUNK * (2 * k_dim + v_dim) + _GDN_CHUNK * (k_dim + v_dim) // 2 + 3 * k_dim * v_dim)
        per_token += 2 * gdn_layers * (projections + conv + scan)
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

    flat = sum(estimate_row_flops(config, flat_depths, flat_scored))
    tree = sum(estimate_row_flops(config, tree_depths, tree_scored))
    return {
        "flat_flops": float(flat),
        "tree_flops": float(tree),
        "flops_ratio": tree / flat,
        "flops_saved": 1.0 - tree / flat,
        "token_ratio": tree_tokens / flat_tokens,
    }


def estimate_row_flops(config, depths: np.ndarray, scored: int | None = None) -> tuple[float, float]:
    """Forward FLOPs of rows of a packed forest, `(decoder layers, LM head)`.

    Args:
        config: as `estimate_flops`'.
        depths: `(R,)` the rows' depths (position ids): a row at depth `t` attends to its `t + 1`
            ancestors-or-self, wherever they were computed (a chunk's context rows count for the chunk's queries).
        scored: rows the LM head runs on; default every row.
    """
    depths = np.asarray(depths, dtype=np.int64)
    linear, pair_costs = _layer_costs(config)
    head = 2 * config.hidden_size * config.vocab_size
    layers = len(depths) * linear + _pairs(depths, _attention_spans(config), pair_costs)
    return float(layers), float((len(depths) if scored is None else scored) * head)


_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "attention", "hybrid")


def _attention_spans(config) -> list[tuple[str, int | None]]:
    """Per attention layer: ("full", None), ("window", W) or ("chunk", C), from `layer_types` and the window fields."""
    window = config_field(config, "sliding_window")
    chunk = config_field(config, "attention_chunk_size")
    kinds = config_field(config, "layer_types")
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


def _pairs(depths: np.ndarray, spans: list[tuple[str, int | None]], costs: list[int]) -> int:
    """FLOPs of the (query, key) pairs of queries at `depths`, summed over the attention layers at each layer's cost
    per pair (a query at depth t sees its t + 1 ancestors-or-self, at most W of them in a window, those of its own
    chunk in a chunked layer)."""
    seen = {
        "full": lambda size: depths + 1,
        "window": lambda size: np.minimum(depths + 1, size),
        "chunk": lambda size: depths % size + 1,
    }
    return int(sum(cost * int(seen[kind](size).sum()) for (kind, size), cost in zip(spans, costs, strict=True)))
