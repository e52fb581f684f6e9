"""Which models may run a packed tree: a positive gate.

A model runs a tree only when exactness is established: its family (`config.model_type`) is listed in
`EXACT_FAMILIES` — each one checked by the coverage matrix (`tests/test_coverage.py`, tree log-probs and
entropies equal to per-sequence `eager` forwards, docs/coverage.md) — and its config stays inside what that check
covers:

- decoder-only causal LM (the family's `*ForCausalLM` class of transformers' auto mapping, or a subclass);
- every layer kind in `IMPLEMENTED_LAYER_KINDS` (one entry per kind: attention that is a mask over earlier tokens,
  and the state-carrying kinds `hf_tree_attn.recurrent` runs segment by segment), and every state-carrying layer
  class one that `hf_tree_attn.recurrent.TREE_LAYERS` implements;
- RoPE whose frequencies do not depend on the forward's longest position, or depend on it in a way the packing
  reproduces (`rope_split_lengths`, `rope_length_limit`);
- a plain `nn.Linear` LM head whose logits the tree head reproduces (`logit_scale`, `final_logit_softcapping`).

Everything else is refused with the reason and the way out (`tree_packing=False`, or the stock
`attn_implementation`). `REFUSED_FAMILIES` names the reason for each family of the installed transformers that
is not exact, so the coverage matrix knows every family; a family in neither table (a newer transformers) is
refused as unverified.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

import torch
import transformers
from packaging.version import Version

from .attention import registration_error
from .recurrent import (
    STATE_LAYER_TYPES,
    TREE_LAYERS,
    _class_path,
    kwargs_breaks,
    tree_layer_types,
    unsupported_recurrent_layers,
)
from .transformers_compat import hub_kernels_in, hub_kernels_off
from .transformers_compat import install as install_transformers_wrappers

__all__ = [
    "EXACT_FAMILIES",
    "IMPLEMENTED_LAYER_KINDS",
    "LOGIT_SCALE_FIELDS",
    "REFUSED_FAMILIES",
    "check_forest",
    "check_lengths",
    "check_tree_model",
    "config_support_error",
    "coverage_markdown",
    "fsdp2_sharded",
    "logit_scale",
    "peft_config_error",
    "release_hub_kernels",
    "rope_length_limit",
    "rope_split_lengths",
    "tree_support_error",
    "unwrap_model",
    "write_coverage_table",
]

ATTN_IMPLEMENTATION = "tree_flex"  # the name registered by hf_tree_attn.attention

# Layer kinds (`config.layer_types` values) a tree runs exactly, and how. A kind whose attention is a mask over
# earlier tokens needs nothing here beyond the model's own mask function, which `tree_flex_mask` reads at depths.
# Kinds that carry state from token to token run segment by segment (`hf_tree_attn.recurrent`); a kind name is only
# the config's label, so the model-level gate also checks every such layer's class against what is implemented
# (a "linear_attention" layer may be a Gated DeltaNet, which is, or MiniMax's lightning attention, which is not).
IMPLEMENTED_LAYER_KINDS: dict[str, str] = {
    "full_attention": "causal attention over the ancestors",
    "sliding_attention": "ancestors fewer than `sliding_window` depths up (the model's window mask read at depths)",
    "chunked_attention": "ancestors in the same chunk of `attention_chunk_size` depths (Llama 4)",
    "mlp": "no attention: a per-token MLP",
    "moe": "no attention: a per-token mixture of experts",
    **dict.fromkeys(
        STATE_LAYER_TYPES,
        "state-carrying (gated / Kimi delta rule, Mamba-2, short conv): segment by segment, level by level, each "
        "segment from its parent segment's final state (hf_tree_attn.recurrent), if the layer class is implemented",
    ),
}

# RoPE types whose frequencies never depend on the sequence: a token's rotation is a function of its depth.
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})

# Every config field that scales a model's logits (before `final_logit_softcapping`), in one place, and whether the
# model multiplies or divides by it: the tree LM head applies `logit_scale(config)` as the model's own forward and
# TRL's fused LM head do. (Granite and MiniCPM3 divide by `logits_scaling`; HyperCLOVA X multiplies.)
LOGIT_SCALE_FIELDS: dict[str, str] = {
    "logit_scale": "multiply",  # Cohere, Cohere2, Cohere2-MoE
    "logits_scaling": "divide",  # Granite, GraniteMoE(-Shared, -SWA), MiniCPM3; HyperCLOVA X multiplies
    "lm_head_multiplier": "multiply",  # Falcon-H1
    "output_multiplier": "multiply",
}
_MULTIPLIES_LOGITS_SCALING = ("hyperclovax",)

# Families verified exact by the coverage matrix (tests/test_coverage.py), with what their tiny model exercised.
EXACT_FAMILIES: dict[str, str] = {
    "afmoe": "sliding window, MoE",
    "apertus": "",
    "apertus1p5_text": "",
    "arcee": "",
    "aria_text": "MoE",
    "axk1": "MoE, MLA",
    "bailing_hybrid": "Kimi delta rule, MoE, MLA",
    "bamba": "Mamba-2",
    "beam": "sliding window, MoE, final softcap",
    "biogpt": "",
    "bitnet": "",
    "codegen": "",
    "cohere": "logit scale",
    "cohere2": "sliding window, logit scale",
    "cohere2_moe": "sliding window, MoE, logit scale",
    "cohere_compass_text": "sliding window",
    "ctrl": "",
    "cwm": "sliding window",
    "dbrx": "MoE",
    "deepseek_v2": "MoE, MLA",
    "deepseek_v3": "MoE, MLA",
    "diffllama": "",
    "dots1": "MoE",
    "emu3": "",
    "ernie4_5": "",
    "ernie4_5_moe": "MoE",
    "exaone": "",
    "exaone4": "sliding window",
    "exaone_moe": "sliding window, MoE",
    # from transformers 5.25 (`_VERSION_ROWS`)
    "falcon": "dense; from transformers 5.25 (earlier releases cannot load it with tree_flex); ALiBi configs refused",
    "falcon_h1": "Mamba-2, logit scale",
    "flex_olmo": "MoE",
    "flint": "sliding window, MoE, attention sinks",
    "fuyu": "",
    "gemma": "",
    "gemma2": "sliding window, attention softcap, final softcap",
    "gemma3": "sliding window",
    "gemma3_text": "sliding window",
    "gemma3n_text": "sliding window, final softcap",
    "gemma4": "sliding window",
    "gemma4_text": "sliding window",
    "gemma4_unified": "sliding window",
    "gemma4_unified_text": "sliding window",
    "glm": "",
    "glm4": "",
    "glm4_moe": "MoE",
    "glm4_moe_lite": "MoE, MLA",
    "got_ocr2": "sliding window",
    "gpt-sw3": "",
    "gpt2": "",
    "gpt_bigcode": "",
    "gpt_neox": "",
    "gpt_oss": "sliding window, MoE, attention sinks",
    "gptj": "",
    "granite": "logit scale",
    "granite_swa": "sliding window, attention sinks, logit scale",
    "granitemoe": "MoE, logit scale",
    "granitemoe_swa": "sliding window, MoE, attention sinks, logit scale",
    "granitemoehybrid": "Mamba-2, MoE",
    "granitemoeshared": "MoE, logit scale",
    "helium": "",
    "hrm_text": "",
    "hunyuan_v1_dense": "",
    "hunyuan_v1_moe": "MoE",
    "hy_v3": "MoE",
    "hyperclovax": "logit scale",
    "internlm3": "",
    "iquestcoder": "",
    "jais2": "",
    "jetmoe": "MoE",
    "kimi_linear": "Kimi delta rule, MoE, MLA",
    "kolibri1": "sliding window, MoE",
    "laguna": "MoE",
    "lara_mini": "gated delta rule, sliding window, MoE",
    "lfm2": "short conv",
    "lfm2_moe": "short conv, MoE",
    "lfm3": "short conv, sliding window",
    "llama": "",
    "llama4": "chunked attention, MoE",
    "llama4_text": "chunked attention, MoE",
    "longcat_flash": "MoE, MLA",
    "mellum": "MoE",
    "mimo_v2_flash": "sliding window, MoE, attention sinks",
    "minicpm3": "MLA, logit scale",
    "minicpm5_moe": "MoE",
    "minimax_m2": "MoE",
    "minimax_m3_vl_text": "MoE",
    "ministral": "sliding window",
    "ministral3": "sliding window",
    "mistral": "sliding window",
    "mixtral": "sliding window, MoE",
    "mllama": "",
    "moshi": "",
    "moss_transcribe_diarize": "sliding window",
    "nanochat": "final softcap",
    "nemotron": "",
    "nemotron_h": "Mamba-2, MoE",
    "olmo": "",
    "olmo2": "",
    "olmo3": "sliding window",
    "olmo_hybrid": "gated delta rule",
    "olmoe": "MoE",
    "opt": "",
    "param2moe": "MoE",
    "persimmon": "",
    "phi": "",
    "phi3": "sliding window",
    "phi4_multimodal": "sliding window",
    "phimoe": "sliding window, MoE",
    "qwen2": "sliding window",
    "qwen2_moe": "sliding window, MoE",
    "qwen3": "sliding window",
    "qwen3_5": "gated delta rule",
    "qwen3_5_moe": "gated delta rule, MoE",
    "qwen3_5_moe_text": "gated delta rule, MoE",
    "qwen3_5_text": "gated delta rule",
    "qwen3_moe": "sliding window, MoE",
    "qwen3_next": "gated delta rule, MoE",
    "sarvam_mla": "MoE, MLA",
    "sarvam_moe": "MoE",
    "seed_oss": "",
    "smollm3": "sliding window",
    "solar_open": "MoE",
    "stablelm": "",
    "starcoder2": "sliding window",
    "vaultgemma": "sliding window, attention softcap, final softcap",
    "youtu": "MLA",
    "zamba2": "Mamba-2",
}

# Every other causal-LM family of transformers 5.24 and 5.25, with the reason it is refused.
_ENCODER_DECODER = "the decoder of an encoder-decoder model; trees need a decoder-only causal LM."
_ENCODER = (
    "a BERT-style encoder run as a decoder (transformers also lists it as a masked LM); trees are verified for "
    "decoder-only LMs only."
)
_BYPASS = (
    "its attention does not run through transformers' AttentionInterface (`_can_set_attn_implementation()` is "
    "False), so it cannot see tree masks; with tree_flex its ordinary forwards raise instead of misreading the mask."
)
_LOAD_FAILS = (
    "it picks its attention class by implementation name from its own table, so it cannot be loaded with "
    "attn_implementation='tree_flex' at all (KeyError: 'tree_flex')."
)
_FALCON_BEFORE_5_25 = (
    "before transformers 5.25 it picks its attention class by implementation name from its own table, so it cannot "
    "be loaded with attn_implementation='tree_flex' at all (KeyError: 'tree_flex'); transformers 5.25's Falcon runs "
    "its attention through AttentionInterface and is exact on trees (ALiBi configs aside): upgrade transformers."
)
_ALIBI = (
    "ALiBi adds a bias to the attention mask that grows with a key's row in the packed row, not with its depth in "
    "the tree, so a tree forward would score ancestors at the wrong distances."
)
_FP32_LOGITS_HEAD = (
    "its LM head (`ErgoLinearWithFP32Output`) rounds the final hidden states (float32) to the weight's dtype and "
    "returns float32 logits, which the tree LM head (a plain linear map of `lm_head.weight`) does not reproduce "
    "in bfloat16."
)
_INDEXED = (
    "DeepSeek sparse attention (`indexed_attention`): an indexer keeps each query's top-k keys of the whole row, "
    "which is not a mask over earlier tokens (measured off by ~1 nat on a tree)."
)
_DRAFTER = "a speculative-decoding drafter that reads the target model's cache; not a standalone policy."


def _state(kinds: str) -> str:
    return f"layers that carry state from token to token ({kinds}) are not implemented on trees yet."


REFUSED_FAMILIES: dict[str, str] = {
    **dict.fromkeys(
        ["bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "musicgen",
         "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "whisper"],
        _ENCODER_DECODER,
    ),
    **dict.fromkeys(
        ["bert", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert", "reformer",
         "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta",
         "xlm-roberta-xl", "xmod"],
        _ENCODER,
    ),
    "bert-generation": _ENCODER,
    **dict.fromkeys(["bloom", "cpmant", "gpt_neox_japanese", "mpt", "openai-gpt", "trocr", "xglm", "xlnet"], _BYPASS),
    **dict.fromkeys(["git", "gpt_neo"], _LOAD_FAILS),
    **dict.fromkeys(["axk2", "deepseek_v32", "dots3_note", "dots3_note_text", "glm_moe_dsa", "hy_v4"], _INDEXED),
    "kolibri1_1": (
        "sparse attention (`indexed_attention`): an indexer keeps each query's top-k keys of the whole row plus the "
        "row's first and latest tokens, which is not a mask over earlier tokens."
    ),
    "ergo": _FP32_LOGITS_HEAD,
    **dict.fromkeys(["gemma4_assistant", "gemma4_unified_assistant"], _DRAFTER),
    "falcon_mamba": _state("Mamba"),
    "inkling2_loop_text": _state("`hybrid` recurrent layers"),
    "inkling2_text": _state("`hybrid` recurrent layers"),
    "inkling_text": _state("`hybrid` recurrent layers"),
    "jamba": _state("Mamba"),
    "mamba": _state("Mamba"),
    "mamba2": (
        "Mamba2ForCausalLM.forward does not pass the model's keyword arguments on to its backbone, so a tree forward "
        "cannot reach its Mamba-2 layers (the Mamba-2 hybrids, Zamba2 among them, are exact)."
    ),
    "minimax": _state("lightning linear attention"),
    "qwen4_exp": _state("linear attention"),
    "qwen4_exp_text": _state("linear attention"),
    "recurrent_gemma": _state("RG-LRU recurrence"),
    "rwkv": _state("RWKV time mixing"),
    "xlstm": _state("mLSTM"),
    "zamba": _state("Mamba"),
    "zaya": _state("`hybrid` recurrent layers"),
    "blt": "its byte-to-patch cross-attention builds masks outside transformers' mask functions.",
    "deepseek_v4": (
        "compressed sparse attention (KV compressed over blocks of positions) is not a mask over earlier tokens."
    ),
    "doge": (
        "dynamic mask attention builds its own mask: a learned bias per key, and beyond `keep_window_size` keys "
        "each query keeps its top-k keys of the whole row."
    ),
    "dory": "its LM head (`DoryLMHead`) is not a plain nn.Linear, which the tree LM head needs.",
    "gemma3n": (
        "Gemma3nForConditionalGeneration is not verified (its vision tower needs timm); for text, "
        "Gemma3nForCausalLM (`gemma3n_text`) is exact."
    ),
    "modernbert-decoder": (
        "its logits come from a prediction head (dense, activation, norm) before the output embedding, which the "
        "tree LM head does not run."
    ),
}  # fmt: skip

# What depends on the installed transformers release. The families a release added have no row before it;
# `_VERSION_ROWS`: {family: (the first release of its EXACT_FAMILIES row, its REFUSED_FAMILIES reason before)}.
# docs/coverage.md shows the rows of the newest release read (`transformers_compat.TRANSFORMERS_CHECKED`).
_ADDED_IN: dict[str, tuple[str, ...]] = {"5.25.0": ("ergo", "kolibri1_1", "minicpm5_moe", "param2moe")}
_VERSION_ROWS: dict[str, tuple[str, str]] = {"falcon": ("5.25.0", _FALCON_BEFORE_5_25)}


def _installed_before(release: str) -> bool:
    return Version(transformers.__version__).release < Version(release).release


for _release, _families in _ADDED_IN.items():
    if _installed_before(_release):
        for _family in _families:
            EXACT_FAMILIES.pop(_family, None)
            REFUSED_FAMILIES.pop(_family, None)
for _family, (_release, _before) in _VERSION_ROWS.items():
    if _installed_before(_release):
        EXACT_FAMILIES.pop(_family)
        REFUSED_FAMILIES[_family] = _before


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP-style wrappers and DeepSpeed's engine (`.module`); PEFT and FSDP2 models are
    returned as is. The engine forwards unknown attributes to its module (so it seems to have `get_decoder`) but
    has a `config` of its own, DeepSpeed's."""
    while hasattr(model, "module") and (not hasattr(model, "get_decoder") or _is_deepspeed_engine(model)):
        model = model.module
    return model


def _is_deepspeed_engine(model: torch.nn.Module) -> bool:
    deepspeed = sys.modules.get("deepspeed")  # not imported: no engine can exist
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


def config_field(config, *names, default=None):
    """The first of `names` the config has set (not None), else `default`; never raises (a config with per-layer
    values, Gemma 4's `head_dim`, refuses a global read of them with its own exception type)."""
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
            value = None
        if value is not None:
            return value
    return default


def logit_scale(config) -> float:
    """What the model multiplies its LM head's output by, before any final softcap (1.0 for most models)."""
    config = config.get_text_config()
    scale = 1.0
    for name, how in LOGIT_SCALE_FIELDS.items():
        value = getattr(config, name, None)
        if value is None:
            continue
        if how == "divide" and config.model_type not in _MULTIPLIES_LOGITS_SCALING:
            value = 1.0 / value
        scale *= value
    return float(scale)


def _rope_parameters(config) -> list[dict]:
    """Every RoPE parameter dict of `config` (one, or one per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "rope_theta" in params:
        return [params]
    return [p for p in params.values() if isinstance(p, dict)]


def _rope_types(config) -> set[str]:
    return {p.get("rope_type", "default") for p in _rope_parameters(config)}


def rope_split_lengths(config) -> tuple[int, ...]:
    """Length classes a forest must not mix for `longrope` RoPE (Phi-3/3.5 128k, Phi-4-mini).

    `longrope` rotates every token of a forward with its long factors when the forward's longest position is
    beyond `original_max_position_embeddings`, with its short factors otherwise. A sequence's own forward decides
    by its own length, so a forest holds only sequences on one side of each threshold (see
    `pack_forest(split_lengths=...)`); the forest's longest position then picks the same factors.
    """
    config = config.get_text_config()
    splits = set()
    for params in _rope_parameters(config):
        if params.get("rope_type") == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            splits.add(int(original))
    return tuple(sorted(splits))


def rope_length_limit(config) -> int | None:
    """Most tokens a packed sequence may have for a `dynamic` (NTK) RoPE model to stay exact, else None.

    Dynamic NTK rescales the frequencies for a forward whose longest position reaches `max_position_embeddings`,
    and keeps a grown scale until a shorter forward resets it: above the limit a sequence's numbers depend on what
    it is packed with and on earlier forwards. Below it every forward uses the unscaled frequencies.
    """
    config = config.get_text_config()
    if not any("dynamic" in t for t in _rope_types(config)):
        return None
    return int(config.max_position_embeddings) - 1


def check_forest(model: torch.nn.Module, forest) -> None:
    """Raise if `forest` holds sequences whose positions the model's RoPE would not treat as their own forwards."""
    check_lengths(unwrap_model(model).config, forest.seq_offsets.diff())


def check_lengths(config, lengths: torch.Tensor) -> None:
    """`check_forest` on the lengths `(N,)` of the sequences packed in one forest."""
    limit, splits = rope_length_limit(config), rope_split_lengths(config)
    if limit is None and not splits:
        return
    lengths = lengths.cpu()
    if limit is not None and int(lengths.max()) > limit:
        raise ValueError(
            f"A packed sequence has {int(lengths.max())} tokens, but this model's dynamic RoPE rescales its "
            f"frequencies from {limit + 1} tokens on, so packed and unpacked numbers would differ. Trees are exact "
            f"for sequences of at most {limit} tokens: truncate them, or train with tree_packing=False "
            "(tree_packing='auto' does so for the batches that need it)."
        )
    for split in splits:
        if bool((lengths > split).any()) and bool((lengths <= split).any()):
            raise ValueError(
                f"This forest mixes sequences of at most and of more than {split} tokens, but the model's longrope "
                f"RoPE rotates them with different factors (original_max_position_embeddings={split}). Pack with "
                "`pack_forest(..., split_lengths=rope_split_lengths(model.config))` (sequence_logprobs and the "
                "trainer do)."
            )


def _fix(model_type: str) -> str:
    return (
        f"Train this {model_type!r} model with tree_packing=False (TreeGRPOTrainer's default tree_packing='auto' "
        "does so by itself), or load it with its stock attn_implementation ('sdpa' / 'eager')."
    )


def _family_of(model: torch.nn.Module) -> str | None:
    """The family (a key of transformers' causal-LM auto mapping) of `model`: its config's `model_type` when that
    maps to the model's class, else the first key whose class the model is (wrappers whose `config` is a text
    sub-config, e.g. Emu3ForCausalLM, and classes shared by several families, e.g. LlamaForCausalLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(model.config, "model_type", None)
    mro = {cls.__name__ for cls in type(model).__mro__}
    if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) in mro:
        return model_type
    for family, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if name in mro and (family in EXACT_FAMILIES or family in REFUSED_FAMILIES):
            return family
    return None


def config_support_error(config, family: str | None = None) -> str | None:
    """Why a model of this config cannot run a packed tree exactly, or None.

    Args:
        config: the model config (its text config is checked for layer kinds and RoPE).
        family: the model's family; default `config.model_type`. A model type that is not a family of the auto
            mapping (a wrapper's text sub-config, custom code) is judged by its layer kinds and RoPE only: that is
            what `tree_flex_mask` asks on every tree forward; `tree_support_error` resolves the family first.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = family or getattr(config, "model_type", None)
    if family in REFUSED_FAMILIES:
        return f"model_type {family!r}: {REFUSED_FAMILIES[family]} " + _fix(family)
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(config).__name__} is an encoder-decoder config; trees need a decoder-only causal LM. " + _fix(
            family
        )
    if family not in EXACT_FAMILIES and family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"model_type {family!r} is not among the families hf_tree_attn has verified exact "
            "(hf_tree_attn.support.EXACT_FAMILIES, docs/coverage.md). " + _fix(family)
        )
    text_config = config.get_text_config()
    unknown = sorted(set(getattr(text_config, "layer_types", None) or ()) - set(IMPLEMENTED_LAYER_KINDS))
    if unknown:
        return (
            f"{type(config).__name__} has layer types {unknown}, which trees do not implement (implemented: "
            f"{sorted(IMPLEMENTED_LAYER_KINDS)}); layers that carry state from token to token would leak it across "
            "tree branches. " + _fix(family)
        )
    if getattr(text_config, "alibi", None) is True:  # Falcon's ALiBi variants (Falcon-RW)
        return f"{type(config).__name__} has alibi=True: {_ALIBI} " + _fix(family)
    rope = sorted(
        t for t in _rope_types(text_config) if t not in _STATIC_ROPE_TYPES | {"longrope"} and "dynamic" not in t
    )
    if rope:
        return f"{type(config).__name__} uses rope_type {rope}, whose behaviour on trees is not verified. " + _fix(
            family
        )
    return None


def tree_support_error(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run a packed tree exactly (a message naming the reason and the way out), or None.

    Does not look at the attention implementation (`check_tree_model` does): the trainer asks before switching a
    model to `tree_flex`.
    """
    install_transformers_wrappers()  # a model checked for trees gets them; the state-layer check reads what it found
    model = unwrap_model(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = _family_of(base)
    if family is None:
        model_type = getattr(model.config, "model_type", None)
        return (
            f"{type(base).__name__} (model_type {model_type!r}) is not a causal LM class of a family hf_tree_attn has "
            "verified exact (hf_tree_attn.support.EXACT_FAMILIES, docs/coverage.md). " + _fix(model_type)
        )
    return (
        config_support_error(model.config, family)
        or peft_config_error(getattr(model, "active_peft_config", None))  # a PeftModel's adapter in use
        or _state_layer_error(model)
        or _lm_head_error(model)
    )


def peft_config_error(config) -> str | None:
    """Why a PEFT adapter of this `PeftConfig` cannot run on packed trees (the reason and the way out), or None."""
    if getattr(config, "is_prompt_learning", False):  # prompt / prefix / p-tuning
        return (
            f"The PEFT adapter is {config.peft_type.value} (prompt learning): PeftModel.forward puts its virtual "
            "tokens in front of each row, and a packed tree holds many sequences in one row, so only the first "
            "would see them. Train it with tree_packing=False, or use a LoRA-style adapter (LoraConfig)."
        )
    if getattr(config, "is_adaption_prompt", False):
        return (
            f"The PEFT adapter is {config.peft_type.value}: it replaces the attention modules with its own, which "
            "trees are not verified with. Train it with tree_packing=False, or use a LoRA-style adapter (LoraConfig)."
        )
    return None


def _hub_kernel_error(model: torch.nn.Module) -> str | None:
    """Why Hugging Face Hub kernels keep `model` off trees, or None: one swapped into a state-carrying layer (its
    forward, a module below it, or its copy of a kernel function) would run out of the tree's dispatch, so the
    layer's state would run across branches. A model whose `use_kernels` is on is refused even with nothing swapped
    in yet: transformers' `train()` / `eval()` kernelize it again on its device of the moment."""
    if not tree_layer_types(model):
        return None
    way_out = (
        "Load the model with use_kernels=False (from transformers 5.25 on, from_pretrained swaps Hub kernels in "
        "unless told not to); the tree picks flash-linear-attention's and causal-conv1d's kernels itself where they "
        "are installed."
    )
    layers = {name for name, m in model.named_modules() if _class_path(type(m)) in TREE_LAYERS}
    swapped = hub_kernels_in(model, layers)
    if swapped:
        return (
            f"{type(model).__name__} has Hugging Face Hub kernels (the `kernels` package) in its state-carrying "
            f"layers ({', '.join(swapped[:3])}{', ...' if len(swapped) > 3 else ''}), which bypass the tree's "
            f"dispatch, so the layers' state would run across branches. {way_out}"
        )
    if getattr(model, "use_kernels", False):
        return (
            f"{type(model).__name__} was loaded with use_kernels=True: Hugging Face Hub kernels (the `kernels` "
            "package) may replace a state-carrying layer's forward or its kernel functions (on CUDA transformers "
            "maps the Gated DeltaNet's `chunk_gated_delta_rule` and the Mamba layers' `causal_conv1d_fn` to Hub "
            "kernels), which bypasses the tree's dispatch, so the layer's state would run across branches. None may "
            "be swapped in yet, but `model.train()` and `model.eval()` (the Trainer calls `train()` every step) swap "
            f"them in again on the device the model is on then. {way_out}"
        )
    return None


def release_hub_kernels(model: torch.nn.Module, reason: str | None) -> bool:
    """Where `reason` (the gate's) is `model`'s Hugging Face Hub kernels in or on a state-carrying model
    (`_hub_kernel_error`): turn them off (`use_kernels`, which `from_pretrained` turns on by default from
    transformers 5.25 on; any swapped in go back to transformers' own), with one warning, as a tree trainer switches
    the attention to `tree_flex`; True then, and the trainer asks the gate again. Outside the trainers
    (`check_tree_model`, `sequence_logprobs`) such a model is refused with the way out instead."""
    inner = unwrap_model(model)
    released = reason is not None and reason == _hub_kernel_error(inner) and hub_kernels_off(inner)
    if released:
        warnings.warn(
            f"{type(inner).__name__} was loaded with use_kernels=True; the tree trainer turned Hugging Face Hub "
            "kernels off (use_kernels=False): the ones transformers maps to state-carrying layers (the Gated "
            "DeltaNet's `chunk_gated_delta_rule`, the Mamba layers' `causal_conv1d_fn`) bypass the tree's dispatch, "
            "so the layers' state would run across branches. The tree picks flash-linear-attention's and "
            "causal-conv1d's kernels itself where they are installed. Load the model with use_kernels=False to "
            "silence this.",
            stacklevel=3,
        )
    return released


def _state_layer_error(model: torch.nn.Module) -> str | None:
    # Only the decoder layers run on a tree: a vision or audio tower (Phi-4-multimodal's depthwise convolutions)
    # sees only multimodal inputs, which the trainer keeps on the flat path.
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    refused = unsupported_recurrent_layers(layers if isinstance(layers, torch.nn.ModuleList) else model)
    if not refused:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes kwargs on
        refused = {
            name: f"{where}, so a tree forward's `tree_forest` cannot reach it and its state would run across branches"
            for name, where in kwargs_breaks(base).items()
        }
    if not refused and (hub := _hub_kernel_error(model)) is not None:
        return hub
    if not refused:
        return None
    reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
    return f"{type(model).__name__} has state-carrying layers a tree cannot run exactly ({reasons}). " + _fix(
        getattr(model.config, "model_type", None)
    )


def check_tree_model(model: torch.nn.Module) -> None:
    """Raise a clear error if `model` cannot score a packed tree exactly (see the module docstring)."""
    inner = unwrap_model(model)
    impl = getattr(inner.config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"The model uses attn_implementation={impl!r}; tree packing needs {ATTN_IMPLEMENTATION!r}. Load it with "
            f"`from_pretrained(..., attn_implementation={ATTN_IMPLEMENTATION!r})` or call "
            f"`model.set_attn_implementation({ATTN_IMPLEMENTATION!r})` (after `import hf_tree_attn`)."
        )
    error = registration_error()  # the name is transformers-wide: another package may hold it
    if error is not None:
        raise ValueError(error)
    error = tree_support_error(inner)
    if error is not None:
        raise NotImplementedError(error)


def ranks_max(values: Sequence[int], device: torch.device) -> list[int]:
    """The largest of each of `values` over the running process group's ranks, every rank calling it alike: one
    all-reduce, on `device` where it is CUDA (NCCL), else on the CPU (gloo). The smallest: negate."""
    values = torch.tensor(list(values), dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in values.tolist()]


def fsdp2_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` (or a module of it) is sharded by FSDP2's `fully_shard` in a running process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _is_fsdp2_class(cls: type) -> bool:
    """Whether `cls` is the class FSDP2's `fully_shard` swaps a module's for: `FSDP<Class>(FSDPModule, Class)`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return len(cls.__bases__) == 2 and cls.__bases__[0] is FSDPModule


def _lm_head_error(model: torch.nn.Module) -> str | None:
    head = model.get_output_embeddings()
    # PEFT `modules_to_save=["lm_head"]` wraps a plain copy per adapter and resolves `.weight` to the active one
    # (the original with adapters disabled), so it is exact; a LoRA layer's `.weight` would miss its delta.
    base = getattr(head, "original_module", head)
    # `torch.compile` of the head (accelerate's `compile_regions` compiles it whole) computes the same linear map.
    base = getattr(base, "_orig_mod", base)
    cls = type(base)
    if _is_fsdp2_class(cls):  # the same map, sharded
        cls = cls.__bases__[-1]
    if hasattr(head, "lora_A"):
        return (
            f"The output embedding is a {type(head).__name__} (a LoRA on `lm_head`), not a plain nn.Linear. The tree "
            "LM head reads `lm_head.weight` directly: leave `lm_head` out of the adapter's target_modules (to train "
            "it, use `modules_to_save=['lm_head']` instead)."
        )
    if cls is not torch.nn.Linear:
        return (
            f"The output embedding is a {type(head).__name__}, not a plain nn.Linear: the tree LM head reads "
            "`lm_head.weight` directly and cannot reproduce its logits. Train this model with tree_packing=False."
        )
    return None


_TABLE_START = "<!-- coverage table: generated by hf_tree_attn.support.write_coverage_table -->"
_TABLE_END = "<!-- end of coverage table -->"


def coverage_markdown() -> str:
    """The family table of docs/coverage.md (between its markers), from `EXACT_FAMILIES` and `REFUSED_FAMILIES`."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    exact = sum(f in EXACT_FAMILIES for f in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    total = len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = [
        _TABLE_START,
        f"transformers {transformers.__version__}: {total} causal-LM families, {exact} exact, "
        f"{total - exact} refused.",
        "",
        "| family (`model_type`) | class | trees | exercised by the tiny model / why refused |",
        "|---|---|---|---|",
    ]
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
        if family in EXACT_FAMILIES:
            rows.append(f"| `{family}` | {name} | exact | {EXACT_FAMILIES[family] or 'dense'} |")
        else:
            rows.append(f"| `{family}` | {name} | refused | {REFUSED_FAMILIES.get(family, 'not listed')} |")
    return "\n".join([*rows, _TABLE_END])


def write_coverage_table(path: str) -> None:
    """Replace the table between the markers of `path` (docs/coverage.md) with `coverage_markdown()`."""
    with open(path) as f:
        text = f.read()
    start, end = text.index(_TABLE_START), text.index(_TABLE_END) + len(_TABLE_END)
    with open(path, "w") as f:
        f.write(text[:start] + coverage_markdown() + text[end:])
