"""`TreeGRPOConfig`: `trl.GRPOConfig` plus the tree-packing fields (only the new fields live here)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import GRPOConfig

__all__ = ["TreeGRPOConfig"]


@dataclass
class TreeGRPOConfig(GRPOConfig):
    """`trl.GRPOConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's)."""

    tree_packing: bool = field(
        default=True,
        metadata={
            "help": "Compute the old-policy, reference and policy log-probabilities on packed prefix trees (one "
            "forward per forest; a shared prompt is computed once). False = exactly trl.GRPOTrainer."
        },
    )
    max_tokens_per_mb: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one packed forward (a multiple of 128, at least the longest prompt + "
            "max_completion_length). None = one forest per TRL chunk of per_device_train_batch_size rows."
        },
    )
    tree_max_token_ratio: float = field(
        default=0.9,
        metadata={
            "help": "Fall back to TRL's flat forward for a chunk whose packed forests hold more than this fraction of "
            "the tokens TRL's flat forward would run (rows x padded width; logged as tree_compute_ratio). Flat SDPA "
            "on full rows is 5 to 15 percent faster per token than the FlexAttention tree, so 0.9 keeps the tree "
            "only where it pays; fallbacks are logged as tree_fallback. 1.0 = always the tree."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.tree_max_token_ratio <= 1.0:
            raise ValueError(
                f"tree_max_token_ratio={self.tree_max_token_ratio} must be in (0, 1]; use 1.0 to always pack trees."
            )
        if self.tree_packing and not 0 < self.temperature < float("inf"):
            raise ValueError(
                f"temperature={self.temperature}: the tree log-probabilities divide the logits by the sampling "
                "temperature (as TRL does), so it must be a finite number > 0, e.g. temperature=1.0."
            )
        if self.max_tokens_per_mb is not None:
            if isinstance(self.max_tokens_per_mb, bool) or not isinstance(self.max_tokens_per_mb, int):
                raise TypeError(
                    f"max_tokens_per_mb={self.max_tokens_per_mb!r} is a {type(self.max_tokens_per_mb).__name__}; "
                    "pass an int multiple of 128 (e.g. max_tokens_per_mb=4096) or None."
                )
            if self.max_tokens_per_mb <= 0 or self.max_tokens_per_mb % 128:
                fix = max(128, -(-self.max_tokens_per_mb // 128) * 128)
                raise ValueError(
                    f"max_tokens_per_mb={self.max_tokens_per_mb} must be a positive multiple of 128 (FlexAttention's "
                    f"block size); use e.g. max_tokens_per_mb={fix}, or None for one forest per chunk."
                )
            if self.max_completion_length is not None and self.max_tokens_per_mb <= self.max_completion_length:
                fix = -(-(self.max_completion_length + 1) // 128) * 128
                raise ValueError(
                    f"max_tokens_per_mb={self.max_tokens_per_mb} cannot hold one sequence: a completion alone can be "
                    f"max_completion_length={self.max_completion_length} tokens, plus its prompt. Use at least "
                    f"{fix} plus your longest prompt (rounded up to 128), or None."
                )
        fsdp_ac = bool(self.fsdp) and str((self.fsdp_config or {}).get("activation_checkpointing")).lower() == "true"
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            fsdp_ac |= os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"
        if fsdp_ac and self.gradient_checkpointing:
            raise ValueError(
                "FSDP activation checkpointing is on (fsdp_activation_checkpointing in the accelerate config / "
                "fsdp_config) and so is gradient_checkpointing=True (TRL's default); transformers refuses both. Pass "
                "`--gradient_checkpointing false` (FSDP's checkpointing replaces it) or turn FSDP's off."
            )
