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

import torch

__all__ = ["activation_bytes", "layers_to_checkpoint", "recompute_only", "spread", "unpriced_reason"]


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


def layers_to_checkpoint(num_layers: int, tree_tokens: int, flat_tokens: int, whole: int, checkpointed: int) -> int:
    """Fewest checkpointed layers whose activations over `tree_tokens` fit in those of `flat_tokens` with all
    `num_layers` checkpointed (`num_layers` if none fits). Byte counts per token per layer, from `activation_bytes`."""
    budget = flat_tokens * (num_layers * checkpointed + whole)
    for count in range(num_layers + 1):
        transient = whole if count else 0  # a checkpointed layer is rebuilt whole during the backward
        if tree_tokens * (count * checkpointed + (num_layers - count) * whole + transient) <= budget:
            return count
    return num_layers


def spread(num_layers: int, count: int) -> list[bool]:
    """`count` of `num_layers` flags True, evenly spaced (every k-th layer): `spread(6, 2)` = `[F, F, T, F, F, T]`."""
    if not 0 <= count <= num_layers:
        raise ValueError(f"count={count} must be between 0 and num_layers={num_layers}.")
    return [(i + 1) * count // num_layers > i * count // num_layers for i in range(num_layers)]


def _checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


@contextlib.contextmanager
def recompute_only(model: torch.nn.Module, count: int | None):
    """Within the block, only `count` of the model's checkpointed decoder layers (evenly spaced) checkpoint.

    transformers decides per layer per forward (`GradientCheckpointingLayer.gradient_checkpointing`), and a
    checkpointed layer's recompute does not consult the flag again, so restoring it after the forward is safe. Layers
    the user left un-checkpointed stay so; `count=None` (or a model without gradient checkpointing) changes nothing.
    """
    layers = _checkpointed_layers(model) if count is not None else []
    try:
        for layer, keep in zip(layers, spread(len(layers), min(count, len(layers)) if layers else 0)):
            layer.gradient_checkpointing = keep
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True
