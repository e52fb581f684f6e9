"""Recompute only what memory needs: how many decoder layers a tree forward checkpoints.

TRL turns gradient checkpointing on by default: every decoder layer keeps only its input in the forward and runs
again in the backward (one more forward per step, a third more compute). A forest holds its shared prompt once,
so it has far fewer tokens than TRL's flat rows of the same sequences and needs far less of that recompute to fit.
The rule here keeps a tree forward's activations within what the flat forward of the same sequences holds with
every layer checkpointed — so the tree's peak memory stays at or below flat's — and recomputes as few layers as
that allows, evenly spaced. It is exact either way: a recomputed layer repeats the same operations on the same
inputs.

Per token, bytes kept until the backward (bf16 activations `b = 2`, RMSNorm's float32 copies `4`):

    checkpointed layer   b * hidden                                              (its input)
    layer kept whole     (4 + 2b) * 2 * hidden          two RMSNorms: fp32 input, its bf16 cast, the output
                       + (4 + b) * (q + kv)             q / k norms (Qwen3): fp32 input and bf16 cast
                       + b * (3 * q + 2 * kv)           RoPE'd q and k, v, attention output and its contiguous copy
                       + 4 * b * intermediate           SwiGLU: gate, up, activation, product
                       + 4 * (2 + 2 * heads + kv_heads) norm scales, attention log-sum-exp

plus, while the backward recomputes a checkpointed layer, one whole layer. Fused kernels (Liger, inductor) keep
less than "whole", so the estimate errs toward recomputing more, never toward using more memory than flat.

Attention kept (`keep_attention`): where the shared-prefix kernels (`prefix_attention.py`) or the gathered paths
(`varlen_attention.py`) serve a forest, a checkpointed layer also keeps their output and log-sum-exp (selective
activation checkpointing: `torch.utils.checkpoint`'s `context_fn` with the kernels' op marked must-save), so its
recompute runs the projections, norms and MLP again but not the attention, the costliest part of a long prompt's
layer. Per token it keeps `b * q + 4 * heads` more, which the rule prices. It needs transformers' non-reentrant
checkpoint (TRL's default, `use_reentrant=False`); with any other checkpoint function the layers recompute whole.
FlexAttention's compiled kernel is opaque to `context_fn` in eager layers, so forests it serves recompute their
attention as before.

The formula prices one kind of layer: attention (any mask kind) with at most two layer norms (plus q / k norms)
and one MLP of `intermediate_size`. Other layers keep more, up to several times more: mixture-of-experts layers
(router, `top_k` expert inputs), multi-head latent attention, state-carrying mixers (Gated DeltaNet, Mamba-2,
short convolutions), layers with four norms (Gemma 2 / 3, GLM-4). For those `activation_bytes` raises and
`tree_recompute="auto"` recomputes every layer, as `"all"` does: no saving, and never more memory than flat.
`tests/test_recompute.py` measures what autograd saves per layer in every family the trees accept and checks the
formula is an upper bound wherever it prices the layers.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .compile import checkpoint_side_effects_once

__all__ = [
    "activation_bytes",
    "attention_output_bytes",
    "checkpoint_count",
    "checkpoint_fits",
    "keeps_attention",
    "layers_to_checkpoint",
    "recompute_only",
    "spread",
    "unpriced_reason",
]


_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "moe_intermediate_size")
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")


def unpriced_reason(config, decoder_layer: torch.nn.Module | None = None) -> str | None:
    """Why `activation_bytes` cannot bound the layers of this decoder config (and, if given, of one of its decoder
    layer modules), or None when it can (see the module docstring)."""
    from .support import config_field

    for name in ("hidden_size", "intermediate_size", "num_attention_heads"):
        if not isinstance(config_field(config, name), int):
            return f"its config has no integer `{name}`"
    experts = [f for f in _EXPERT_FIELDS if config_field(config, f)]
    if experts:
        return f"mixture-of-experts layers (`{experts[0]}`)"
    if config_field(config, "kv_lora_rank"):
        return "multi-head latent attention (`kv_lora_rank`)"
    kinds = sorted(set(config_field(config, "layer_types") or ()) - set(_ATTENTION_LAYER_TYPES))
    if kinds:
        return f"layer types {kinds}"
    if decoder_layer is not None:
        from .recurrent import _owns_state

        if any(_owns_state(m) for m in decoder_layer.modules()):
            return "state-carrying layers"
        norms = [n for n, m in decoder_layer.named_children() if "norm" in type(m).__name__.lower()]
        if len(norms) > 2:
            return f"{len(norms)} layer norms per layer ({', '.join(norms)})"
    return None


def activation_bytes(config, dtype_bytes: int = 2, decoder_layer: torch.nn.Module | None = None) -> tuple[int, int]:
    """`(whole, checkpointed)`: bytes per token one decoder layer keeps for the backward without and with
    checkpointing (see the module docstring), for a decoder config (`hidden_size`, `intermediate_size`,
    `num_attention_heads`, `num_key_value_heads`, `head_dim`) and, if given, one of its decoder layer modules.

    Raises:
        NotImplementedError: for layers the formula does not price (`unpriced_reason`).
    """
    reason = unpriced_reason(config, decoder_layer)
    if reason is not None:
        raise NotImplementedError(f"activation_bytes does not price {reason}.")
    d, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    q = heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    b, kv_heads = dtype_bytes, kv // head_dim
    norms = (4 + 2 * b) * 2 * d + (4 + b) * (q + kv)
    whole = norms + b * (3 * q + 2 * kv + 4 * inter) + 4 * (2 + 2 * heads + kv_heads)
    return whole, b * d


def attention_output_bytes(config, dtype_bytes: int = 2) -> int:
    """Bytes per token a checkpointed layer that keeps its attention (`recompute_only(keep_attention=True)`) keeps
    more: the output `(q_heads * head_dim)` in the activations' dtype and the float32 log-sum-exp per head."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return dtype_bytes * heads * head_dim + 4 * heads


def layers_to_checkpoint(
    num_layers: int,
    tree_tokens: int,
    flat_tokens: int,
    whole: int,
    checkpointed: int,
    kept_attention: int = 0,
    budget_bytes: int = 0,
) -> int:
    """Fewest checkpointed layers whose activations over `tree_tokens` fit in those of `flat_tokens` with all
    `num_layers` checkpointed, or in `budget_bytes` where that is more (`num_layers` if none fits). Byte counts per
    token per layer, from `activation_bytes`; `kept_attention` (`attention_output_bytes`): what the tree's
    checkpointed layers keep more than flat's."""
    budget = max(flat_tokens * (num_layers * checkpointed + whole), budget_bytes)
    for count in range(num_layers + 1):
        if tree_tokens * _kept_bytes(num_layers, count, whole, checkpointed, kept_attention) <= budget:
            return count
    return num_layers


def _kept_bytes(num_layers: int, count: int, whole: int, checkpointed: int, kept_attention: int) -> int:
    transient = whole if count else 0  # a checkpointed layer is rebuilt whole during the backward
    return count * (checkpointed + kept_attention) + (num_layers - count) * whole + transient


def checkpoint_count(
    config,
    tree_tokens: int,
    flat_tokens: int,
    dtype_bytes: int = 2,
    keep_attention: bool = False,
    budget_gib: float | None = None,
) -> int:
    """`layers_to_checkpoint` for a decoder config whose layers `activation_bytes` prices: the checkpointed layers
    keep their attention outputs too if `keep_attention`, and `budget_gib` (`tree_activation_budget_gib`) counts
    where it is more than flat's bound."""
    whole, kept = activation_bytes(config, dtype_bytes=dtype_bytes)
    attention = attention_output_bytes(config, dtype_bytes) if keep_attention else 0
    budget_bytes = int((budget_gib or 0) * 2**30)
    return layers_to_checkpoint(
        config.num_hidden_layers, tree_tokens, flat_tokens, whole, kept, attention, budget_bytes=budget_bytes
    )


def checkpoint_fits(
    config,
    tree_tokens: int,
    flat_tokens: int,
    count: int,
    dtype_bytes: int = 2,
    keep_attention: bool = False,
    budget_gib: float | None = None,
) -> bool:
    """Whether `count` checkpointed layers (keeping their attention outputs if `keep_attention`) hold the
    activations of `tree_tokens` within `checkpoint_count`'s bound: `checkpoint_count` answers every layer both when
    every layer fits and when nothing does."""
    whole, kept = activation_bytes(config, dtype_bytes=dtype_bytes)
    attention = attention_output_bytes(config, dtype_bytes) if keep_attention else 0
    layers = config.num_hidden_layers
    budget = max(flat_tokens * (layers * kept + whole), int((budget_gib or 0) * 2**30))
    return tree_tokens * _kept_bytes(layers, count, whole, kept, attention) <= budget


def spread(num_layers: int, count: int) -> list[bool]:
    """`count` of `num_layers` flags True, evenly spaced (every k-th layer): `spread(6, 2)` = `[F, F, T, F, F, T]`."""
    if not 0 <= count <= num_layers:
        raise ValueError(f"count={count} must be between 0 and num_layers={num_layers}.")
    return [(i + 1) * count // num_layers > i * count // num_layers for i in range(num_layers)]


def _checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def _keep_kernel_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op is torch.ops.hf_tree_attn.prefix_attention.default or op is torch.ops.hf_tree_attn.path_attention.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_KEEP_ATTENTION_CONTEXTS = functools.partial(create_selective_checkpoint_contexts, _keep_kernel_outputs)
# Compiled layers guard on their checkpoint function: the same object for every forward, or they would recompile.
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _keeping_attention(func):
    """`func` (a layer's `_gradient_checkpointing_func`) with the kernels' outputs kept, or None where `func` is not
    transformers' plain non-reentrant checkpoint (reentrant, offloading, a user's own `context_fn`)."""
    if not (isinstance(func, functools.partial) and func.func is checkpoint and not func.args):
        return None
    if func.keywords.get("use_reentrant") is not False or "context_fn" in func.keywords:
        return None
    if func not in _kept:
        _kept[func] = functools.partial(checkpoint, **func.keywords, context_fn=_KEEP_ATTENTION_CONTEXTS)
    return _kept[func]


def keeps_attention(model: torch.nn.Module) -> bool:
    """Whether `recompute_only(model, count, keep_attention=True)` can keep attention outputs: every checkpointed
    decoder layer uses transformers' non-reentrant checkpoint (module docstring)."""
    layers = _checkpointed_layers(model)
    return bool(layers) and all(_keeping_attention(layer._gradient_checkpointing_func) for layer in layers)


@contextlib.contextmanager
def recompute_only(model: torch.nn.Module, count: int | None, keep_attention: bool = False):
    """Within the block, only `count` of the model's checkpointed decoder layers (evenly spaced) checkpoint, and with
    `keep_attention` (where `keeps_attention(model)`) those keep the shared-prefix kernels' outputs.

    transformers decides per layer per forward (`GradientCheckpointingLayer.gradient_checkpointing`), and a
    checkpointed layer's recompute does not consult the flag again, so restoring it after the forward is safe. Layers
    the user left un-checkpointed stay so; `count=None` (or a model without gradient checkpointing) changes nothing.
    Compiled layers traced within the block keep their checkpointed forward's side effects once
    (`compile.checkpoint_side_effects_once`: transformers' attention modules from 5.25 on make one).
    """
    layers = _checkpointed_layers(model) if count is not None else []
    functions = [layer._gradient_checkpointing_func for layer in layers]
    kept = [_keeping_attention(f) for f in functions] if keep_attention else []
    if kept and not all(kept):
        raise ValueError(
            "keep_attention=True needs transformers' non-reentrant checkpoint in every checkpointed layer "
            "(gradient_checkpointing_kwargs={'use_reentrant': False}, no context_fn): check keeps_attention(model)."
        )
    try:
        for layer, on in zip(layers, spread(len(layers), min(count, len(layers)) if layers else 0)):
            layer.gradient_checkpointing = on
        for layer, func in zip(layers, kept):
            layer._gradient_checkpointing_func = func
        with checkpoint_side_effects_once():
            yield
    finally:
        for layer, func in zip(layers, functions):
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = func
