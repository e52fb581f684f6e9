"""`attn_implementation="tree_flex"`: the attention function registered in transformers' `AttentionInterface`.

What it does depends only on the `attention_mask` the model hands it:

- a `BlockMask` (a packed forest on CUDA) → compiled FlexAttention, GQA via `enable_gqa`, Gemma2's softcap
  as a `score_mod`;
- a 4-D tensor (the forest's dense bool mask on CPU, or an ordinary padding mask) or `None` → exactly the
  `sdpa` path (or HF's eager math for softcap models, which SDPA cannot express).

So one model object serves tree training and ordinary forwards / `generate`. The mask function is registered
too (`AttentionMaskInterface`): without it transformers hands every forward `attention_mask=None`, and padded
batches and left-padded `generate` would silently attend to padding.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

__all__ = ["ATTN_IMPLEMENTATION", "register", "tree_flex_attention", "tree_flex_mask"]

ATTN_IMPLEMENTATION = "tree_flex"

_compiled_flex_attention = None


def _flex_attention(*args, **kwargs):
    global _compiled_flex_attention
    if torch.compiler.is_compiling():  # already inside a compiled region: let the outer compile fuse it
        return flex_attention(*args, **kwargs)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=None)
    return _compiled_flex_attention(*args, **kwargs)


@functools.cache
def _softcap_score_mod(softcap: float):
    """One function object per softcap value, so the compiled kernel is reused across calls."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _check_sliding_window(module: torch.nn.Module, sliding_window: int | None, forest) -> None:
    """A tree is exact under a sliding window only if no token is `sliding_window` or more tokens deep."""
    if sliding_window is None:
        return
    if forest is None:
        raise ValueError(
            f"Layer {getattr(module, 'layer_idx', '?')} uses sliding_window={sliding_window}, but the tree depth is "
            "unknown. Pass `tree_forest=forest` to the forward (`forest_forward_kwargs` and TreeDataCollator do this)."
        )
    tree_max_depth = forest.max_depth
    if tree_max_depth >= sliding_window:
        raise ValueError(
            f"Layer {getattr(module, 'layer_idx', '?')} uses sliding_window={sliding_window}, but the packed tree "
            f"holds a sequence {tree_max_depth + 1} tokens long, which the window would cut. tree_flex supports "
            f"sliding-window layers only for sequences of at most {sliding_window} tokens: truncate them, or train "
            "this model without tree packing."
        )


def _eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """HF's eager attention math (`(batch, heads, seq, head_dim)` in, `(batch, seq, heads, head_dim)` out).

    `attention_mask` is `(batch, 1, q_len, kv_len)`, bool (True = attend) or additive float; `None` = causal.
    """
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def tree_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for packed prefix trees, registered as `attn_implementation="tree_flex"`.

    Args:
        module: the calling attention layer (`.layer_idx`, `.num_key_value_groups`, `.is_causal`).
        query: `(batch, q_heads, q_len, head_dim)`, after RoPE.
        key: `(batch, kv_heads, kv_len, head_dim)`, not repeated for GQA.
        value: `(batch, kv_heads, kv_len, head_dim)`.
        attention_mask: `BlockMask` (tree, CUDA), `(batch, 1, q_len, kv_len)` tensor (tree on CPU, or padding),
            or `None`.
        scaling: softmax scale (Gemma2/3 pass `query_pre_attn_scalar ** -0.5`).
        dropout: must be 0 — FlexAttention has no dropout, and a tree forward must be deterministic.
        **kwargs: `softcap`, `sliding_window` (from the model), `tree_forest` (the `PackedForest`, from
            `forest_forward_kwargs` / the collator),
            `kernel_options` (FlexAttention).

    Returns:
        `(attn_output, None)` with `attn_output` `(batch, q_len, q_heads, head_dim)` contiguous.
    """
    if dropout > 0:
        raise ValueError(
            f"tree_flex does not support attention dropout (got dropout={dropout}); set the model config's "
            "`attention_dropout=0.0`."
        )
    if kwargs.get("s_aux") is not None:  # SDPA would silently drop the sinks: wrong outputs, even without a tree
        raise NotImplementedError(
            f"{type(module).__name__} uses attention sinks (`s_aux`, e.g. GPT-OSS), which tree_flex does not "
            "implement. Load this model with its stock attn_implementation and train it without tree packing."
        )
    softcap = kwargs.get("softcap")
    forest = kwargs.get("tree_forest")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5

    if isinstance(attention_mask, BlockMask):
        _check_sliding_window(module, kwargs.get("sliding_window"), forest)
        if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
            raise RuntimeError(
                "tree_flex got a BlockMask on CPU in a forward that needs gradients, but FlexAttention has no "
                "backward on CPU. Pass the dense mask instead: `attention_mask=forest.dense_mask()` "
                "(`forest.attention_mask(device)` and TreeDataCollator choose it automatically off CUDA)."
            )
        enable_gqa = query.shape[1] != key.shape[1]
        num_q_heads = query.shape[1]
        if enable_gqa and num_q_heads & (num_q_heads - 1):  # same fallback as transformers' flex integration
            key = repeat_kv(key, num_q_heads // key.shape[1])
            value = repeat_kv(value, num_q_heads // value.shape[1])
            enable_gqa = False
        out = _flex_attention(
            query,
            key,
            value,
            score_mod=None if softcap is None else _softcap_score_mod(float(softcap)),
            block_mask=attention_mask,
            scale=scaling,
            enable_gqa=enable_gqa,
            kernel_options=kwargs.get("kernel_options"),
        )
        return out.transpose(1, 2).contiguous(), None

    if forest is not None:
        _check_sliding_window(module, kwargs.get("sliding_window"), forest)
    if softcap is not None:
        return _eager_attention(module, query, key, value, attention_mask, scaling, softcap), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def tree_flex_mask(*args, config=None, **kwargs):
    """Mask function for ordinary (non-tree) forwards: SDPA's bool mask, or eager's float mask for softcap models."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return eager_mask(*args, config=config, **kwargs)
    return sdpa_mask(*args, config=config, **kwargs)


def register() -> None:
    """Register `tree_flex` with transformers (idempotent; runs on `import hf_tree_attn`)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_flex_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, tree_flex_mask)
