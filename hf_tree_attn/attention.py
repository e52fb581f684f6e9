"""`attn_implementation="tree_flex"`: the attention and mask functions registered with transformers.

Two registrations, one per interface:

- `tree_flex_mask` (`AttentionMaskInterface`) is what the model's own mask builders (`create_causal_mask`,
  `create_sliding_window_causal_mask`, `create_chunked_causal_mask`, …) call with each layer kind's flat mask
  function. Given a forest's `attention_mask` (see `PackedForest.attention_mask`) it returns that layer kind's
  *tree* mask — the flat mask read at depths, intersected with ancestor-or-self (`hf_tree_attn.masks`) — so
  sliding windows, chunks and whatever else a model puts in its masks carry over to trees with the model's own
  conventions. Given anything else it returns exactly what `sdpa` (or `eager`, for softcap models) would.
- `tree_flex_attention` (`AttentionInterface`) runs whatever mask it gets: a `BlockMask` → compiled
  FlexAttention (GQA via `enable_gqa`, softcap as a `score_mod`, attention sinks folded in through the returned
  log-sum-exp); a dense mask or `None` → exactly the `sdpa` path, or HF's eager math for softcap and sink models.

So one model object serves tree training and ordinary forwards / `generate`: without a forest, `tree_flex` is
`sdpa` (eager where the model has no SDPA). Models whose attention bypasses `AttentionInterface` (MPT, Bloom,
XGLM, …) would silently misuse the mask, so their first forward raises.

The name is transformers-wide, so `register()` refuses to replace a `tree_flex` another package registered (naming
it and the way out), and the gate (`support.check_tree_model`) checks that a model on `tree_flex` runs these very
functions (`registration_error`): a `tree_flex` registered over them afterwards is never taken for this one.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .masks import ContextMaskSource, is_tree_mask_mod, mask_tag
from .prefix_attention import prefix_attention
from .prefix_attention import serves as prefix_serves
from .prefix_attention import supports as prefix_supports
from .varlen_attention import path_attention, path_serves

__all__ = [
    "ATTN_IMPLEMENTATION",
    "FORCE_REGISTER_ENV",
    "bypasses_attention_interface",
    "register",
    "registration_error",
    "tree_flex_attention",
    "tree_flex_mask",
]

ATTN_IMPLEMENTATION = "tree_flex"
# Set to 1 to let `register()` (which `import hf_tree_attn` runs) replace a `tree_flex` another package registered.
FORCE_REGISTER_ENV = "HF_TREE_ATTN_FORCE_REGISTER"

# FlexAttention `kernel_options` for tree_flex calls on CUDA that bring none of their own (the model kwarg
# `kernel_options`), from the JSON of HF_TREE_ATTN_FLEX_KERNEL_OPTIONS at import; may be set at run time (a dict or
# None). E.g. {"BACKEND": "FLASH"}: FlashAttention-4's kernels behind the same block mask (needs the `flash_attn.cute`
# package), which the tree trainers set by default where they compile the layers of the measured kind on a Hopper
# or Blackwell GPU (`trainer.compile_setting.default_flash_backend`; '{}' keeps the Triton kernels). With it the masks
# capture no symbolic size, which its lowering refuses (`masks.static_rows`). Not applied with a softcap
# (FlashAttention-4's backward takes no score modification).
FLEX_KERNEL_OPTIONS_ENV = "HF_TREE_ATTN_FLEX_KERNEL_OPTIONS"


def _kernel_options_from_env() -> dict | None:
    text = os.environ.get(FLEX_KERNEL_OPTIONS_ENV, "").strip()
    if not text:
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{FLEX_KERNEL_OPTIONS_ENV}={text!r} is not JSON ({error}): give FlexAttention's kernel_options as a JSON "
            'object, e.g. {"BACKEND": "FLASH"}, or unset it.'
        ) from None
    if not isinstance(options, dict):
        raise ValueError(
            f"{FLEX_KERNEL_OPTIONS_ENV}={text!r} must be a JSON object of FlexAttention's kernel_options, e.g. "
            '{"BACKEND": "FLASH"}, or unset.'
        )
    return options


FLEX_KERNEL_OPTIONS: dict | None = _kernel_options_from_env()

# Config fields that restrict which earlier positions a layer sees (a sliding window, a chunk): the forest's plain
# ancestor-or-self mask handed to every layer would silently drop them.
_WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")


def _declare_block_multiples(query: torch.Tensor, key: torch.Tensor) -> None:
    """Where FlexAttention is traced (in compiled layers, or compiled on its own), tell the compiler which of the
    query and key lengths `(batch, heads, len, dim)` are multiples of its 128-row blocks, as the forests pad their
    rows to be (`pad_multiple`); called eagerly it checks what holds anyway.

    With dynamic shapes a length is a symbol the compiler knows nothing of, and inductor generates FlexAttention's
    kernels for arbitrary lengths (`IS_DIVISIBLE` off: bounds masks on every tile's loads and scores) unless it can
    prove both lengths multiples of 128. The test below guards the graph on it (a graph of other lengths is
    compiled apart, without the claim; a data-dependent length is left unclaimed); `torch._check` records the fact
    in the shape environment. Measured on an H100, torch 2.11's inductor did not act on it (`IS_DIVISIBLE` stayed
    off, no step time changed); it costs nothing, and a later inductor may read it.
    """
    for length in (query.shape[-2], key.shape[-2]):
        if guard_or_false(length % 128 == 0):
            torch._check(length % 128 == 0)


def _flex_with_grad(query, key, value, **kwargs):
    _declare_block_multiples(query, key)
    return flex_attention(query, key, value, **kwargs)


def _flex_without_grad(query, key, value, **kwargs):
    _declare_block_multiples(query, key)
    return flex_attention(query, key, value, **kwargs)


# FlexAttention compiled once per grad mode: dynamo guards on the grad mode and counts a function's graphs against
# its recompile limit (8 per code object). Prefix reuse calls it without grad (its forward) and with (the chunks'
# recomputes) on shapes that change from chunk to chunk; in one code object those graphs passed the limit, after
# which every call silently ran the eager reference (the full float32 scores matrix: out of memory on an H200 at
# 65k-row chunks). Two wrappers, two code objects, two budgets.
_COMPILED_FLEX: dict[bool, Callable] = {}


def _compiled_flex(grad: bool) -> Callable:
    """The compiled FlexAttention for calls with (`grad=True`) or without autograd."""
    if grad not in _COMPILED_FLEX:
        _COMPILED_FLEX[grad] = torch.compile(_flex_with_grad if grad else _flex_without_grad, dynamic=None)
    return _COMPILED_FLEX[grad]


def _flex_attention(query, key, value, return_lse: bool = False, **kwargs):
    """FlexAttention, compiled once per grad mode; `(out, lse | None)` with `lse` `(batch, heads, q_len)` float32
    (natural log)."""
    if return_lse:
        from torch.nn.attention.flex_attention import AuxRequest

        kwargs["return_aux"] = AuxRequest(lse=True)
    # Inside a compiled region the outer compile fuses it; compiled CPU flex has no LSE output (CPU flex is
    # inference-only anyway), so that one case runs the eager reference implementation.
    if torch.compiler.is_compiling() or (return_lse and query.device.type == "cpu"):
        _declare_block_multiples(query, key)
        out = flex_attention(query, key, value, **kwargs)
    else:
        # With autocast off: the inputs already are in the autocast dtype (`_autocast_inputs`), all FlexAttention's
        # autocast does, and dynamo guards on the autocast state, so a forward under autocast and one without would
        # each compile a graph. Graphs of `flex_attention` count against dynamo's recompile limit (8) in the whole
        # process, transformers' compiled flex included; past it every call silently runs the eager reference (the
        # full scores matrix, in float32: slow, memory-bound, other rounding than the kernel).
        with torch.autocast(query.device.type, enabled=False):
            out = _compiled_flex(torch.is_grad_enabled())(query, key, value, **kwargs)
    if return_lse:
        out, aux = out
        return out, aux.lse
    return out, None


def _kernel_options(given: dict | None, query: torch.Tensor, softcap) -> dict | None:
    """The `kernel_options` of a tree_flex FlexAttention call: the caller's, else `FLEX_KERNEL_OPTIONS` on CUDA
    without a softcap (a copy: FlexAttention fills in its defaults). The FLASH backend (FlashAttention-4) takes bf16
    / fp16 inputs only: asked for on others, it is refused here with the way out, not deep in its kernel."""
    if given is not None or FLEX_KERNEL_OPTIONS is None or query.device.type != "cuda" or softcap is not None:
        return given
    if FLEX_KERNEL_OPTIONS.get("BACKEND") == "FLASH" and query.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"{FLEX_KERNEL_OPTIONS_ENV} asks for FlexAttention's FLASH backend, whose FlashAttention-4 kernels take "
            f"bf16 / fp16 inputs, but tree attention's are {query.dtype}. Train in bf16 (bf16 weights, or bf16=True "
            f"for mixed precision), or set {FLEX_KERNEL_OPTIONS_ENV}='{{}}' for FlexAttention's Triton kernels."
        )
    return dict(FLEX_KERNEL_OPTIONS)


@functools.cache
def _softcap_score_mod(softcap: float):
    """One function object per softcap value, so the compiled kernel is reused across calls."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """HF's eager attention math (`(batch, heads, seq, head_dim)` in, `(batch, seq, heads, head_dim)` out).

    `attention_mask` is `(batch, 1, q_len, kv_len)`, bool (True = attend) or additive float; `None` = causal.
    `sinks` `(heads,)`: one extra logit per head in the softmax normaliser whose value column is dropped (GPT-OSS).
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
        scores = scores + attention_mask[..., : key.shape[2]]
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:  # as GPT-OSS's eager attention: the sink joins the softmax, then its column is dropped
        sink = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[2], -1)
        # In the promoted dtype, as `torch.cat` gives it there: float32 for bf16 scores beside float32 sinks (fp32
        # weights under autocast), where rounding the sinks to bf16 would move every probability.
        dtype = torch.promote_types(scores.dtype, sink.dtype)
        combined = torch.cat([scores.to(dtype), sink.to(dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def _autocast_inputs(query, key, value):
    """`query`, `key`, `value` in one dtype: the autocast dtype where `torch.autocast` is on for their device, as
    SDPA and FlexAttention's callers see them. Under autocast the projections come out in the autocast dtype while a
    norm (Qwen3's q / k norms) may keep float32, and the ATen kernels and custom ops behind the tree paths are not
    autocast-aware; a checkpointed layer's recompute runs under the same autocast state, so it casts alike. Float64
    stays float64, as autocast leaves it (a float64 model's projections come out float64 under autocast)."""
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t if t.dtype == torch.float64 else t.to(dtype) for t in (query, key, value))


def _check_forest_mask(module: torch.nn.Module, attention_mask, tag, forest) -> None:
    """A forward that carries `tree_forest` must get tree masks of that forest, not a flat mask."""
    if tag is not None and (tag.role == "full" or (tag.role == "layer" and tag.source.cache is forest._mask_cache)):
        return
    got = type(attention_mask).__name__ if attention_mask is not None else "None"
    raise RuntimeError(
        f"Layer {getattr(module, 'layer_idx', '?')} of {type(module).__name__} got attention_mask={got} instead of "
        "a tree mask of the `tree_forest` passed to this forward. Pass the forest's own mask: "
        "`model(**forest_forward_kwargs(forest, device))` (a copy, or `forest.attention_mask()` moved to another "
        "device, is an ordinary padding mask). If you did, this model builds its masks outside transformers' mask "
        "functions and cannot run trees: train it with tree_packing=False."
    )


def _check_context_mask(module: torch.nn.Module, attention_mask, tag, context) -> None:
    """A chunk of a prefix-reuse forward (`hf_tree_attn.prefix_reuse`) must reach every layer with its context and
    its own masks: a chunk's mask without the context's keys would be read against the chunk's keys alone."""
    chunk_mask = tag is not None and tag.role == "layer" and isinstance(tag.source, ContextMaskSource)
    if context is None and not chunk_mask:
        return
    layer = f"Layer {getattr(module, 'layer_idx', '?')} of {type(module).__name__}"
    if context is None:
        raise RuntimeError(
            f"{layer} got the mask of a prefix-reuse chunk without its `tree_context`: the model's forward does not "
            "pass its keyword arguments on to this layer, so the layer cannot see the keys of earlier chunks. Score "
            "this model with prefix_reuse=False."
        )
    if not chunk_mask or tag.source is not context.mask_source:
        got = type(attention_mask).__name__ if attention_mask is not None else "None"
        raise RuntimeError(
            f"{layer} got `tree_context` with attention_mask={got}, not that chunk's own mask: run prefix reuse "
            "through `hf_tree_attn.prefix_reuse.chunked_forest_logprobs` (or `sequence_logprobs(..., "
            "prefix_reuse=True)`), which builds both."
        )


def _check_full_tree_mask(module: torch.nn.Module, query: torch.Tensor) -> None:
    """`forest.dense_mask()` / `block_mask()` given as `attention_mask` go to every layer as is: refuse them where
    a window or chunk of the model could cut the tree, or where the layer scales queries by their row (Llama 4's
    temperature tuning), which only a forest's own mask lets this function correct."""
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) scales its queries by position "
            "(attention temperature tuning) and got the forest's plain ancestor-or-self mask, which does not carry "
            "the tokens' depths. Pass `**forest_forward_kwargs(forest, device)` instead."
        )
    config = getattr(module, "config", None)
    windows = [getattr(config, name, None) for name in _WINDOW_FIELDS]
    windows = [w for w in windows if isinstance(w, int) and w > 0]
    if not windows or query.shape[2] <= min(windows):
        return
    names = ", ".join(f"{n}={getattr(config, n)}" for n in _WINDOW_FIELDS if getattr(config, n, None) is not None)
    raise ValueError(
        f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) got the forest's plain "
        f"ancestor-or-self mask for {query.shape[2]} tokens, but its config has {names}: a ready-made 4-D mask goes "
        "to every layer as is, so the window would be silently dropped. Pass `attention_mask=forest.attention_mask"
        "(device)` with the forest's `position_ids` (or `**forest_forward_kwargs(forest, device)`): each layer kind "
        "then gets its own tree mask."
    )


def _depth_temperature(module: torch.nn.Module, query: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Llama 4's attention temperature tuning (NoPE layers) by depth instead of the row index it was given.

    The layer scaled `query` by `1 + attn_scale * log1p(floor((row + 1) / floor_scale))`; a tree token's position
    is its depth, so swap the row scale for the depth scale. `query` `(batch, heads, S, head_dim)`, `depth` `(S,)`.
    """

    def scale(positions: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    rows = torch.arange(query.shape[2], device=query.device)
    ratio = scale(depth.to(query.device)) / scale(rows)
    return (query * ratio.view(1, 1, -1, 1)).to(query.dtype)


def _plain_tree_mask(attention_mask, forest) -> bool:
    """Whether `attention_mask` is `forest`'s ancestor-or-self mask itself (its causal layer kind: no window, no
    chunk). Eagerly by its tag; inside a compiled layer, where tags are not seen, by its `BlockMask`'s mask_mod."""
    if torch.compiler.is_compiling():
        return isinstance(attention_mask, BlockMask) and is_tree_mask_mod(attention_mask.mask_mod)
    tag = mask_tag(attention_mask)
    return tag is not None and tag.role == "layer" and tag.causal and tag.source.cache is forest._mask_cache


def _prefix_attention(query, key, value, attention_mask, forest, scaling: float) -> torch.Tensor | None:
    """`(1, q_heads, S, head_dim)` for a layer whose mask is `forest`'s plain tree mask, through dense kernels where
    they serve these tensors: `hf_tree_attn.prefix_attention` for a two-level forest, or on CUDA with
    FlashAttention-4 (`HF_TREE_ATTN_PREFIX_KERNEL=fa4`) `hf_tree_attn.varlen_attention.path_attention` for any
    other; else None (FlexAttention / SDPA)."""
    if not prefix_supports(query) or query.shape[1] % key.shape[1] or not _plain_tree_mask(attention_mask, forest):
        return None
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:  # MLA's wider q / k: FlexAttention
        return None
    size = forest.input_ids.shape[1]
    if query.shape[2] != size or key.shape[2] != size:
        return None
    if prefix_serves(forest, query.device.type):
        return prefix_attention(query, key, value, forest.prefix_plan, scaling)
    if path_serves(forest, query.device.type):
        return path_attention(query, key, value, forest.path_plan, scaling)
    return None  # not two-level, or on CUDA a forest FlexAttention runs faster


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
        module: the calling attention layer (`.layer_idx`, `.config`).
        query: `(batch, q_heads, q_len, head_dim)`, after RoPE.
        key: `(batch, kv_heads, kv_len, head_dim)`, not repeated for GQA.
        value: `(batch, kv_heads, kv_len, head_dim)`.
        attention_mask: this layer kind's mask: a tree `BlockMask` (CUDA) or `(1, 1, S, S)` bool tensor built by
            `tree_flex_mask`, an ordinary `(batch, 1, q_len, kv_len)` mask, or `None` (causal).
        scaling: softmax scale (Gemma2/3 pass `query_pre_attn_scalar ** -0.5`).
        dropout: must be 0 — FlexAttention has no dropout, and a tree forward must be deterministic.
        **kwargs: `softcap`, `s_aux` (attention sinks, `(q_heads,)`), `tree_forest` (the `PackedForest`, from
            `forest_forward_kwargs` / the collator), `tree_context` (one chunk of a prefix-reuse forward: the keys
            and values of its context rows go in front of `key` / `value`, see `hf_tree_attn.prefix_reuse`),
            `kernel_options` (FlexAttention); the rest is ignored.

    Returns:
        `(attn_output, None)` with `attn_output` `(batch, q_len, q_heads, head_dim)` contiguous.
    """
    if dropout > 0:
        raise ValueError(
            f"tree_flex does not support attention dropout (got dropout={dropout}); set the model config's "
            "`attention_dropout=0.0`."
        )
    forest = kwargs.get("tree_forest")
    context = kwargs.get("tree_context")
    if torch.compiler.is_compiling():
        # Regionally compiled layers (masks are built outside, by `tree_flex_mask`): the checks below read
        # Python-side mask tags and would make every new forest a recompilation, so only `tree_forest` counts here.
        depth = forest.position_ids[0] if forest is not None else None
    else:
        tag = mask_tag(attention_mask)
        if forest is not None:
            _check_forest_mask(module, attention_mask, tag, forest)
        _check_context_mask(module, attention_mask, tag, context)
        if tag is not None and tag.role == "full":
            _check_full_tree_mask(module, query)
        depth = tag.source.depth if tag is not None and tag.role == "layer" else None
    if depth is not None:  # a tree forward: row-based extras of the layer would see rows, not positions
        if kwargs.get("position_bias") is not None:
            raise NotImplementedError(
                f"{type(module).__name__} adds a position bias to its attention scores, computed over rows, which a "
                "packed tree does not keep. Train this model with tree_packing=False."
            )
        if getattr(module, "attn_temperature_tuning", False) and not module.use_rope:
            query = _depth_temperature(module, query, depth)
    query, key, value = _autocast_inputs(query, key, value)
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5

    if context is not None:  # keys [context rows; own rows], as the chunk's mask has them
        key, value = context.attend(module, key, value)
    elif forest is not None and softcap is None and sinks is None:
        out = _prefix_attention(query, key, value, attention_mask, forest, scaling)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if isinstance(attention_mask, BlockMask):
        if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
            raise RuntimeError(
                "tree_flex got a BlockMask on CPU in a forward that needs gradients, but FlexAttention has no "
                "backward on CPU. Pass the dense masks instead: `attention_mask=forest.attention_mask(device)` "
                "chooses them off CUDA (`dense=True` forces them)."
            )
        enable_gqa = query.shape[1] != key.shape[1]
        num_q_heads = query.shape[1]
        if enable_gqa and num_q_heads & (num_q_heads - 1):  # same fallback as transformers' flex integration
            key = repeat_kv(key, num_q_heads // key.shape[1])
            value = repeat_kv(value, num_q_heads // value.shape[1])
            enable_gqa = False
        out, lse = _flex_attention(
            query,
            key,
            value,
            return_lse=sinks is not None,
            score_mod=None if softcap is None else _softcap_score_mod(float(softcap)),
            block_mask=attention_mask,
            scale=scaling,
            enable_gqa=enable_gqa,
            kernel_options=_kernel_options(kwargs.get("kernel_options"), query, softcap),
        )
        if sinks is not None:
            # Softmax over [scores, sink] = softmax over scores times exp(lse) / (exp(lse) + exp(sink)).
            keep = torch.sigmoid(lse - sinks.float().view(1, -1, 1))  # (batch, heads, q_len), float32
            out = (out.float() * keep.unsqueeze(-1)).to(query.dtype)
        return out.transpose(1, 2).contiguous(), None

    if softcap is not None or sinks is not None:
        return _eager_attention(query, key, value, attention_mask, scaling, softcap, sinks), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


@functools.cache
def bypasses_attention_interface(model_type: str) -> str | None:
    """The causal LM class name of `model_type` if its attention layers do not call `AttentionInterface`, else None.

    transformers' own test (`PreTrainedModel._can_set_attn_implementation`, which `set_attn_implementation` relies on):
    the modeling module's attention classes must dispatch through `ALL_ATTENTION_FUNCTIONS.get_interface(`. Such a
    model still asks `tree_flex_mask` for its masks but would read them its own way (a bool mask added to the scores
    attends everywhere). Unknown model types (custom code) are not judged.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None or cls._can_set_attn_implementation():
        return None
    return name


# Under a whole-model `torch.compile` this runs eagerly (a graph break where the masks are built, once per forward):
# a forest's mask carrier is recognised by its storage, which a traced fake tensor does not have.
@torch.compiler.disable
def tree_flex_mask(**kwargs):
    """Mask function of `tree_flex` (see the module docstring), called by transformers' mask builders with keyword
    arguments only: a forest's tree mask for this layer kind, or exactly `sdpa`'s mask (`eager`'s for softcap
    models, which run HF's eager math)."""
    config = kwargs.get("config")
    name = bypasses_attention_interface(getattr(config, "model_type", ""))
    if name is not None:
        raise NotImplementedError(
            f"{name} does not run its attention through transformers' AttentionInterface, so it would misread "
            "tree_flex's masks (even ordinary forwards would attend to the wrong tokens). Load it with "
            "attn_implementation='eager' or 'sdpa', and train it with tree_packing=False."
        )
    tag = mask_tag(kwargs.get("attention_mask"))
    if tag is not None and tag.role == "carrier":
        source = tag.source
        shape = tuple(kwargs.get(k) for k in ("batch_size", "q_length", "kv_length"))
        offsets = tuple(int(kwargs.get(k) or 0) for k in ("q_offset", "kv_offset"))
        if shape != (1, source.size, source.size) or offsets != (0, 0):
            raise ValueError(
                f"A forest's attention_mask stands for one packed row of {source.size} tokens, but the model asked "
                f"for a mask of (batch, queries, keys) = {shape} with offsets {offsets}. Pass the forest's own "
                "input_ids and position_ids with use_cache=False (`forest_forward_kwargs(forest, device)`)."
            )
        from .support import check_lengths, config_support_error

        error = config_support_error(config)
        if error is not None:
            raise NotImplementedError(error)
        check_lengths(config, source.seq_lengths)  # the one RoPE length check: every forest forward passes here
        return source.mask(kwargs["mask_function"], use_vmap=kwargs.get("use_vmap", False))
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    build = eager_mask if getattr(text_config, "attn_logit_softcapping", None) is not None else sdpa_mask
    return build(**kwargs)


def _registrations():
    """`(interface class, what models look the name up in, this module's function)`, attention then mask."""
    return (
        (AttentionInterface, ALL_ATTENTION_FUNCTIONS, tree_flex_attention),
        (AttentionMaskInterface, ALL_MASK_ATTENTION_FUNCTIONS, tree_flex_mask),
    )


def _is_ours(function, ours) -> bool:
    """`function` is `ours`, or `ours` from an earlier load of this module (`importlib.reload` makes new objects of
    the same code): the same module, qualified name and source file."""
    if function is ours:
        return True
    code = getattr(inspect.unwrap(function), "__code__", None)
    return (
        getattr(function, "__module__", None) == ours.__module__
        and getattr(function, "__qualname__", None) == ours.__qualname__
        and getattr(code, "co_filename", None) == inspect.unwrap(ours).__code__.co_filename
    )


def _describe(function) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def register(force: bool = False) -> None:
    """Register `tree_flex` with transformers (runs on `import hf_tree_attn`; idempotent, a reload included).

    Refuses (`RuntimeError`) to replace a `tree_flex` that another package registered in `AttentionInterface` or
    `AttentionMaskInterface`, naming it: models loaded on `tree_flex` would silently change attention. `force=True`,
    or the environment variable `HF_TREE_ATTN_FORCE_REGISTER=1` at import, replaces it.
    """
    force = force or os.environ.get(FORCE_REGISTER_ENV, "0") not in ("", "0")
    for interface, lookup, ours in _registrations():
        current = lookup.get(ATTN_IMPLEMENTATION)
        if current is not None and not _is_ours(current, ours) and not force:
            raise RuntimeError(
                f"transformers' {interface.__name__} already holds {ATTN_IMPLEMENTATION!r}: {_describe(current)}, "
                f"not hf_tree_attn's {ours.__qualname__}. hf_tree_attn does not replace it (models loaded on "
                f"{ATTN_IMPLEMENTATION!r} would silently run other attention). Uninstall the package that registers "
                f"it, or leave it unimported; to replace it anyway, set {FORCE_REGISTER_ENV}=1 (before "
                "`import hf_tree_attn`) or call `hf_tree_attn.register(force=True)`."
            )
    for interface, _, ours in _registrations():
        interface.register(ATTN_IMPLEMENTATION, ours)


def registration_error() -> str | None:
    """Why `attn_implementation="tree_flex"` does not run this module's functions (what transformers holds under
    the name, and the way out), or None when it does."""
    for interface, lookup, ours in _registrations():
        current = lookup.get(ATTN_IMPLEMENTATION)
        if current is None:
            return (
                f"transformers' {interface.__name__} holds no {ATTN_IMPLEMENTATION!r}: call hf_tree_attn.register() "
                "(`import hf_tree_attn` does)."
            )
        if not _is_ours(current, ours):
            return (
                f"attn_implementation={ATTN_IMPLEMENTATION!r} runs {_describe(current)} (registered in transformers' "
                f"{interface.__name__} by another package, over hf_tree_attn's), not hf_tree_attn's "
                f"{ours.__qualname__}. Call `hf_tree_attn.register(force=True)` after importing that package, or "
                "uninstall it."
            )
    return None
