"""The tree-packing fields `TreeSFTConfig` and `TreeDPOConfig` add to TRL's configs, and their checks.

Both trainers run TRL's fused LM head on packed forests (`fused_head.py`), so they take the same knobs, with the
meaning `TreeGRPOConfig` gives them: `tree_packing` ("auto" / true / false), `max_tokens_per_mb`,
`tree_max_token_ratio` and `tree_compile` (every tree trainer's; `compile_setting.py`).
"""

from __future__ import annotations

from dataclasses import field

__all__ = [
    "check_tree_compile",
    "check_tree_options",
    "max_tokens_per_mb_field",
    "tree_compile_field",
    "tree_max_token_ratio_field",
    "tree_packing_field",
]

_TREE_PACKING_CHOICES = {"auto": "auto", "true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def tree_packing_field(trainer: str):
    # A str field (not `bool | str`, which HfArgumentParser reads as a bool), normalised by `check_tree_options`.
    return field(
        default="auto",
        metadata={
            "help": "Score each batch on packed prefix trees (one forward per forest; tokens the batch's sequences "
            "share are computed once). 'auto': trees when the model can run them exactly (hf_tree_attn.support), "
            "else TRL's path with one warning naming the reason. 'true': trees, and an error at init if the model "
            f"cannot run them. 'false': exactly trl.{trainer}."
        },
    )


def max_tokens_per_mb_field():
    return field(
        default=None,
        metadata={
            "help": "Token budget of one packed forward (a multiple of 128, at least max_length): a batch whose "
            "forest is larger runs as several forests. None = one forest per batch."
        },
    )


def tree_max_token_ratio_field():
    return field(
        default=0.9,
        metadata={
            "help": "A batch whose forests would hold more than this fraction of the tokens TRL's forward computes "
            "(rows x padded width, or the padding-free packed row) runs TRL's own forward: where almost nothing is "
            "shared, plain (padding-free) packing costs less than a tree. Said once as a warning, logged per batch "
            "as tree_fallback. 1.0 = always the tree."
        },
    )


def tree_compile_field():
    # A str field (not `bool | str`, which HfArgumentParser reads as a bool), normalised by `check_tree_compile`.
    return field(
        default="auto",
        metadata={
            "help": "Compile the decoder layers the trees run (regional torch.compile in place: inductor, dynamic "
            "shapes, one graph for every forest length). 'auto': on CUDA, for models whose layers are attention and "
            "a dense MLP, unless accelerate's dynamo settings or torch_compile ask for a compile (then that one "
            "applies, to the decoder layers). 'true': on any device and model. 'false': only what accelerate or "
            "torch_compile ask for. A compile that fails falls back to eager with one warning naming why. Under "
            "FSDP / DeepSpeed accelerate's own settings decide.",
        },
    )


def check_tree_compile(config) -> None:
    """Normalise `config.tree_compile` to "auto" / True / False; `ValueError` naming a bad value."""
    choice = str(config.tree_compile).strip().lower()
    if choice not in _TREE_PACKING_CHOICES:
        raise ValueError(
            f"tree_compile={config.tree_compile!r}; use 'auto' (compiled decoder layers on CUDA, the default), "
            "'true' (on any device) or 'false' (only a compile accelerate or torch_compile asks for)."
        )
    config.tree_compile = _TREE_PACKING_CHOICES[choice]


def check_tree_options(config) -> None:
    """Normalise `config.tree_packing` to "auto" / True / False and raise `ValueError` naming any bad value."""
    choice = str(config.tree_packing).strip().lower()
    if choice not in _TREE_PACKING_CHOICES:
        raise ValueError(
            f"tree_packing={config.tree_packing!r}; use 'auto' (trees when the model supports them, the default), "
            "'true' (trees or an error) or 'false' (exactly TRL's trainer)."
        )
    config.tree_packing = _TREE_PACKING_CHOICES[choice]
    check_tree_compile(config)
    ratio = config.tree_max_token_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"tree_max_token_ratio={ratio!r} must be in (0, 1]; use 1.0 to always pack trees.")
    budget = config.max_tokens_per_mb
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(
            f"max_tokens_per_mb={budget!r} is a {type(budget).__name__}; pass an int multiple of 128 (e.g. 8192) or "
            "None."
        )
    if budget <= 0 or budget % 128:
        fix = max(128, -(-budget // 128) * 128)
        raise ValueError(
            f"max_tokens_per_mb={budget} must be a positive multiple of 128 (FlexAttention's block size); use e.g. "
            f"max_tokens_per_mb={fix}, or None for one forest per batch."
        )
    max_length = getattr(config, "max_length", None)
    if max_length is not None and max_length > budget:
        fix = -(-max_length // 128) * 128
        raise ValueError(
            f"max_tokens_per_mb={budget} cannot hold one sequence of max_length={max_length} tokens; use "
            f"max_tokens_per_mb={fix} (or more), or None."
        )
