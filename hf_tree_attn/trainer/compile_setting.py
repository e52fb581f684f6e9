"""Which compile a tree trainer runs: the user's, the CUDA default, or none — decided once at init, never dropped.

A user asks for compiled layers through accelerate (`ACCELERATE_DYNAMO_BACKEND`, `..._USE_REGIONAL_COMPILATION`,
`..._USE_DYNAMIC`, `..._MODE`, or the same keys of an accelerate config) or through `TrainingArguments.torch_compile`
(`torch_compile_backend`, `torch_compile_mode`), which transformers hands accelerate as the same `TorchDynamoPlugin`.
accelerate applies it when the trainer prepares the model, on a copy that tree forwards do not reach
(`hf_tree_attn.compile`). So a tree trainer takes the setting over: it compiles the decoder layers of the models its
trees run (the policy, a reference model) in place, at the end of its `__init__`, and tells accelerate not to compile
the policy again. Where accelerate itself compiles in place — FSDP and DeepSpeed — it is left to do so.

`tree_compile` (every tree config): with no compile asked for, `"auto"` (the default) compiles the decoder layers on
CUDA with inductor and dynamic shapes — one graph per layer kind for every forest length — for models whose layers
are attention and a dense MLP (the measured case); `True` does so on any device and model; `False` not at all. A
compile the user asked for applies whatever `tree_compile` says. Left to accelerate (no default) under FSDP and
DeepSpeed, and refused with Liger's kernels (see `_LIGER_REFUSAL`). A whole-model compile request compiles the
layers regionally instead, said once: a whole-model graph breaks where the tree masks are built.

With the layers compiled in place on a Hopper or Blackwell GPU and FlashAttention-4 installed (`flash_attn.cute`),
tree attention runs on FlexAttention's FLASH backend by default (`default_flash_backend`): through
`trainer.train()` it was exact to TRL's float32 run and 1.16x / 1.22x the Triton kernels' step on GRPO groups /
agent conversations at the Qwen3-1.7B shape (benchmarks/results/async_grpo_h100_qwen3-1.7b_flash_compiled*.json).
Only on the measured kind of layers (full attention over one head size of 64 or 128, no sliding window, sinks or
softcap, no prefix reuse), in bf16 / fp16 (bf16 weights, or accelerate's mixed precision), and only where
`HF_TREE_ATTN_FLEX_KERNEL_OPTIONS` is unset (`'{}'` keeps the Triton kernels); a compiled forward that fails on it
turns it off with one warning and stays compiled (`call_compiled`). The next tree trainer's init in the same
process undoes it and decides again.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from dataclasses import dataclass, replace

from ..compile import compile_decoder_layers
from ..recompute import _EXPERT_FIELDS
from ..support import config_field, unwrap_model

__all__ = [
    "CompileDecision",
    "apply_compile",
    "compile_tree_layers",
    "decide_compile",
    "default_flash_backend",
    "prefix_reuse_note",
]

logger = logging.getLogger(__name__)

DEFAULT_COMPILE = {"backend": "inductor", "dynamic": True}
# Measured on an H200 (torch 2.11, liger-kernel 0.8.5; benchmarks/results/grad_check_h200_qwen3-8b.json): at the
# Qwen3-8B shape Liger's kernels alone and inductor-compiled layers alone give the eager model's gradients, the two
# together gradients with cosine -0.0002 to eager (norms up to 21x), on TRL's flat forward and the tree alike.
_LIGER_REFUSAL = (
    "use_liger_kernel=True with compiled decoder layers gave wrong gradients on an H200 (Qwen3-8B shape, torch 2.11, "
    "liger-kernel 0.8.5: cosine -0.0002 to the eager model's, on TRL's flat forward and the tree alike), while "
    "each alone was exact."
)


@dataclass(frozen=True)
class CompileDecision:
    """What a tree trainer compiles.

    Attributes:
        kwargs: the `torch.compile` arguments for the decoder layers, or None (eager, or left to accelerate).
        source: "accelerate" (the user's dynamo settings / `torch_compile`), "default" (`tree_compile`), or "none".
        note: why, in a sentence (for logs and the model card).
    """

    kwargs: dict | None
    source: str
    note: str


def _asked(accelerator):
    """The `TorchDynamoPlugin` of a compile the user asked for, or None."""
    from accelerate.utils import DynamoBackend

    plugin = getattr(accelerator.state, "dynamo_plugin", None)
    return plugin if plugin is not None and plugin.backend != DynamoBackend.NO else None


def _default_refusal(model) -> str | None:
    """Why `tree_compile="auto"` does not compile `model` by default (its layers are not the measured kind)."""
    from ..recurrent import _owns_state

    config = unwrap_model(model).config.get_text_config()
    if any(_owns_state(m) for m in unwrap_model(model).modules()):
        return "its state-carrying layers run their tree scans level by level, with a host loop per level"
    experts = [name for name in _EXPERT_FIELDS if config_field(config, name)]
    if experts:
        return f"its mixture-of-experts layers (`{experts[0]}`) route tokens by data-dependent shapes"
    return None


def decide_compile(args, accelerator, model) -> CompileDecision:
    """The compile a tree trainer runs for `model` under `args` (`tree_compile`, `use_liger_kernel`) and
    `accelerator` (its dynamo plugin, distributed type, device). Raises `ValueError` for a compile the user asked
    for that cannot be exact (with Liger's kernels)."""
    from accelerate.utils import DistributedType

    plugin = _asked(accelerator)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    liger = bool(getattr(args, "use_liger_kernel", False))
    if plugin is not None and liger:
        raise ValueError(
            f"{_LIGER_REFUSAL} A compile is asked for (dynamo backend {plugin.backend.value.lower()}, "
            f"torch_compile={getattr(args, 'torch_compile', False)}): turn off one of the two — "
            "use_liger_kernel=False, or no accelerate dynamo backend and torch_compile=False."
        )
    if plugin is not None and sharded:
        return CompileDecision(None, "accelerate", "accelerate compiles the layers in place under FSDP / DeepSpeed")
    if plugin is not None:
        kwargs = plugin.to_kwargs()
        kwargs["backend"] = str(kwargs.get("backend", plugin.backend.value)).lower()
        if kwargs.get("dynamic") is None:
            kwargs["dynamic"] = True  # every forest has a new length: compile the length-generic graph at once
        if not plugin.use_regional_compilation:
            warnings.warn(
                "A whole-model compile was asked for (torch_compile, or an accelerate dynamo backend without "
                "regional compilation); tree trainers compile the decoder layers instead (regional compilation, "
                f"{kwargs}): a whole-model graph would break where the tree masks are built and specialise on each "
                "forest.",
                stacklevel=4,
            )
        return CompileDecision(kwargs, "accelerate", "the user's dynamo settings, on the decoder layers")
    mode = args.tree_compile
    if mode is False:
        return CompileDecision(None, "none", "tree_compile=False")
    if sharded:
        return CompileDecision(None, "none", "FSDP / DeepSpeed: set accelerate's dynamo settings to compile")
    if liger:
        logger.info("tree_compile=%r: the decoder layers stay eager, as %s", mode, _LIGER_REFUSAL)
        return CompileDecision(None, "none", "use_liger_kernel=True (compiled layers with Liger were not exact)")
    if mode == "auto":
        if accelerator.device.type != "cuda":
            return CompileDecision(None, "none", f"tree_compile='auto' compiles on CUDA only ({accelerator.device})")
        reason = _default_refusal(model)
        if reason is not None:
            logger.info("tree_compile='auto' leaves the decoder layers eager: %s (True compiles them).", reason)
            return CompileDecision(None, "none", f"not by default: {reason}")
    return CompileDecision(dict(DEFAULT_COMPILE), "default", f"tree_compile={mode!r}")


def apply_compile(accelerator, decision: CompileDecision, models) -> None:
    """Compile the decoder layers of `models` (None entries skipped) in place as `decision` says, and keep
    accelerate from compiling a copy of the policy again when the trainer prepares it."""
    if decision.kwargs is None:
        return
    for model in models:
        if model is not None:
            # A reference model TRL prepared already was compiled by accelerate as a copy: compile the original,
            # which the copy's patched forward runs (see `hf_tree_attn.compile`).
            compile_decoder_layers(vars(model).get("_orig_mod", model), **decision.kwargs)
    plugin = _asked(accelerator)
    if plugin is not None:
        from accelerate.utils import DynamoBackend

        accelerator.state.dynamo_plugin = replace(plugin, backend=DynamoBackend.NO)
    logger.info("Compiled decoder layers (%s): %s.", decision.note, decision.kwargs)


_PREFIX_REUSE_EAGER = (
    "tree_prefix_reuse=True: a forest larger than one chunk (under FSDP2, every forest) runs its chunks on the eager "
    "decoder layers, not the compiled ones. {why} Forests of one chunk run compiled."
)
_EAGER_HYBRID = (
    "This model's layers carry a state along the rows, whose kernels read and write the states earlier chunks kept "
    "from Python, which a compiled layer's graph would freeze."
)
_EAGER_ASKED = (
    "HF_TREE_ATTN_PREFIX_REUSE_LAYERS=eager asks for it; unset it to run the compiled layers, which are exact and "
    "ran 1.12x the eager chunks' speed (one H100, Qwen3-1.7B shape, 8 paired steps)."
)


def prefix_reuse_note(args, decision: CompileDecision | None, model) -> str | None:
    """What compiled layers leave out under `tree_prefix_reuse=True`, said once at init: a hybrid's chunks run the
    eager layers, and so do any model's with `HF_TREE_ATTN_PREFIX_REUSE_LAYERS=eager`
    (`hf_tree_attn.prefix_reuse.LAYERS`). A warning where the user asked for the compile (it is not applied
    everywhere they asked), INFO where it is the default. None without prefix reuse, without compiled layers, or
    where the chunks run them (the default, no hybrid)."""
    from .. import prefix_reuse
    from ..recurrent import _owns_state

    if not getattr(args, "tree_prefix_reuse", False) or decision is None or decision.source == "none":
        return None
    if any(_owns_state(m) for m in unwrap_model(model).modules()):
        note = _PREFIX_REUSE_EAGER.format(why=_EAGER_HYBRID)
    elif prefix_reuse.LAYERS != "compiled":
        note = _PREFIX_REUSE_EAGER.format(why=_EAGER_ASKED)
    else:
        return None
    if decision.source == "accelerate":
        warnings.warn(note, stacklevel=4)
    else:
        logger.info(note)
    return note


def compile_tree_layers(args, accelerator, models, trees: bool = True) -> CompileDecision | None:
    """What a tree trainer's init does with compilation, in order: decide (`decide_compile`, on the policy
    `models[0]`), compile the decoder layers of `models` in place (`apply_compile`), the FLASH backend default
    (`default_flash_backend`, which also undoes an earlier trainer's), and what prefix reuse leaves eager for a
    hybrid (`prefix_reuse_note`). `trees=False` (TRL's path): nothing compiled, None returned."""
    decision = decide_compile(args, accelerator, models[0]) if trees else None
    if decision is not None:
        apply_compile(accelerator, decision, models)
    default_flash_backend(args, accelerator, decision, models[0])
    prefix_reuse_note(args, decision, models[0])
    return decision


def _flash_attention_4_installed() -> bool:
    """Whether FlashAttention-4's CuTeDSL package (`flash_attn.cute`), which FlexAttention's FLASH backend runs, is
    importable."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no `flash_attn` at all
        return False


def _device_capability(device) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(device)


def _flash_refusal(model) -> str | None:
    """Why `model`'s layers are not the kind the FLASH backend was measured on, or None."""
    from .. import attention

    config = unwrap_model(model).config.get_text_config()
    reason = _default_refusal(model)
    if reason is not None:
        return reason
    if any(kind != "full_attention" for kind in config_field(config, "layer_types", default=()) or ()):
        return "not every layer is full attention"
    windows = [name for name in attention._WINDOW_FIELDS if config_field(config, name) is not None]
    if windows:
        return f"its attention is windowed (`{windows[0]}`)"
    if config_field(config, "attn_logit_softcapping") is not None:
        return "it softcaps attention scores"
    if config_field(config, "kv_lora_rank", "qk_nope_head_dim") is not None:
        return "its attention is latent (MLA)"
    heads = config_field(config, "num_attention_heads")
    head_dim = config_field(config, "head_dim", default=config.hidden_size // heads if heads else None)
    if head_dim not in (64, 128):
        return f"head size {head_dim} (measured: 64, 128)"
    if any(hasattr(module, "sinks") for module in unwrap_model(model).modules()):
        return "it has attention sinks"
    return None


def _flash_dtype_refusal(accelerator, model) -> str | None:
    """Why tree attention's inputs would not be bf16 / fp16, the only dtypes FlashAttention-4 takes, or None: they
    are the model's dtype, or the autocast dtype under accelerate's mixed precision."""
    import torch

    if getattr(accelerator, "mixed_precision", "no") in ("bf16", "fp16"):
        return None
    dtype = next(unwrap_model(model).parameters()).dtype
    if dtype in (torch.bfloat16, torch.float16):
        return None
    return f"its attention inputs are {dtype} (FlashAttention-4 takes bf16 / fp16)"


# The kernel options `default_flash_backend` put in `attention.FLEX_KERNEL_OPTIONS` (the very dict), None if it put
# none there: the next trainer's default replaces them, where a user's would be kept.
_FLASH_BY_DEFAULT: dict | None = None


def default_flash_backend(args, accelerator, decision: CompileDecision | None, model) -> str | None:
    """Put tree attention on FlexAttention's FLASH backend (FlashAttention-4's kernels behind the same block masks)
    when the trainer compiled `model`'s layers in place (`decision`) on a Hopper / Blackwell GPU with
    `flash_attn.cute` installed, the layers are the measured kind (`_flash_refusal`), prefix reuse is off and the
    user set no kernel options (`HF_TREE_ATTN_FLEX_KERNEL_OPTIONS`), and tree attention's inputs are bf16 / fp16
    (`_flash_dtype_refusal`). Every tree trainer calls it at init, `decision` None where it compiles nothing: an
    earlier trainer's default in the same process is undone first, so it never reaches a model it was not decided
    for. Returns the note it logs, or None where it stays on the Triton kernels."""
    global _FLASH_BY_DEFAULT
    from .. import attention

    if _FLASH_BY_DEFAULT is not None and attention.FLEX_KERNEL_OPTIONS is _FLASH_BY_DEFAULT:
        attention.FLEX_KERNEL_OPTIONS = None  # an earlier trainer's default, not the user's: decided again here
    _FLASH_BY_DEFAULT = None
    if decision is None or decision.kwargs is None or accelerator.device.type != "cuda":
        return None
    if getattr(args, "tree_prefix_reuse", False):
        return None
    if attention.FLEX_KERNEL_OPTIONS is not None or attention.FLEX_KERNEL_OPTIONS_ENV in os.environ:
        return None  # the user's choice
    if _device_capability(accelerator.device)[0] not in (9, 10) or not _flash_attention_4_installed():
        return None
    reason = _flash_refusal(model) or _flash_dtype_refusal(accelerator, model)
    if reason is not None:
        logger.info("Tree attention stays on FlexAttention's Triton kernels: %s.", reason)
        return None
    attention.FLEX_KERNEL_OPTIONS = _FLASH_BY_DEFAULT = {"BACKEND": "FLASH"}
    note = (
        "FlexAttention's FLASH backend (FlashAttention-4) in the compiled layers; "
        f"{attention.FLEX_KERNEL_OPTIONS_ENV}='{{}}' keeps the Triton kernels"
    )
    logger.info("Tree attention on %s.", note)
    return note
