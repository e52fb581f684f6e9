"""`TreeGRPOConfig`: `trl.GRPOConfig` plus the tree-packing fields (only the new fields live here)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from .tree_options import check_tree_compile, tree_compile_field

__all__ = ["TreeGRPOConfig"]

_TREE_PACKING_CHOICES = {"auto": "auto", "true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass
class TreeGRPOConfig(GRPOConfig):
    """`trl.GRPOConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's)."""

    # A str field (not `bool | str`, which HfArgumentParser reads as a bool), normalised in __post_init__ to
    # "auto" / True / False, so `--tree_packing auto|true|false` works through TrlParser.
    tree_packing: str = field(
        default="auto",
        metadata={
            "help": "Compute the old-policy, reference and policy log-probabilities on packed prefix trees (one "
            "forward per forest; a shared prompt is computed once). 'auto': trees when the model can run them "
            "exactly (hf_tree_attn.support), else TRL's flat path with one warning naming the reason (logged as "
            "tree_fallback). 'true': trees, and an error at init if the model cannot run them. 'false': exactly "
            "trl.GRPOTrainer."
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

    tree_balance: bool | None = field(
        default=None,
        metadata={
            "help": "Token-balanced data parallelism: after generation, move whole groups (num_generations rows) "
            "between ranks and between the micro-batches of one optimizer step, so every rank's micro-batch costs "
            "about the same estimated FLOPs (tree tokens, attention pairs, scored rows). Same rows per optimizer "
            "step, so the same loss and gradients. None (default) = on with several processes wherever the loss "
            "does not depend on which rows share a micro-batch (off for loss_type='bnpo', an entropy bonus, "
            "top_entropy_quantile < 1); True = on (an error where the loss depends on it); False = off."
        },
    )
    tree_recompute: str = field(
        default="auto",
        metadata={
            "help": "Activation recompute of tree policy forwards, with gradient_checkpointing on. 'all': every "
            "checkpointed layer recomputes (TRL's behaviour). 'auto': recompute only as many layers (evenly spaced) "
            "as keep the forests' estimated activations within what TRL's flat forward of the same rows holds with "
            "every layer checkpointed: a tree shares its prompt, so most layers need no recompute. Where the "
            "shared-prefix kernels serve a forest, the layers that do recompute keep their attention output "
            "(selective checkpointing; needs use_reentrant=False, TRL's default) and recompute only the rest, "
            "within the same memory bound. Layers whose activations the estimate does not bound (experts, latent "
            "attention, recurrent mixers, four norms) recompute every layer under 'auto' too.",
            "choices": ["auto", "all"],
        },
    )
    tree_activation_budget_gib: float | None = field(
        default=None,
        metadata={
            "help": "With tree_recompute='auto': GiB per device the layer activations of one tree policy forward "
            "may take (the same estimate, an upper bound), where that is more than TRL's flat forward would hold. "
            "None (default) = flat's, so the tree's peak memory stays at or below flat's. A larger budget trades "
            "memory for speed: fewer layers recompute (logged as tree_checkpointed_layers); one that fits every "
            "layer recomputes none."
        },
    )

    tree_compile: str = tree_compile_field()

    def __post_init__(self):
        super().__post_init__()
        check_tree_compile(self)
        choice = str(self.tree_packing).strip().lower()
        if choice not in _TREE_PACKING_CHOICES:
            raise ValueError(
                f"tree_packing={self.tree_packing!r}; use 'auto' (trees when the model supports them, the default), "
                "'true' (trees or an error) or 'false' (exactly trl.GRPOTrainer)."
            )
        self.tree_packing = _TREE_PACKING_CHOICES[choice]
        if self.tree_recompute not in ("auto", "all"):
            raise ValueError(f"tree_recompute={self.tree_recompute!r} must be 'auto' or 'all'.")
        budget = self.tree_activation_budget_gib
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0):
            raise ValueError(
                f"tree_activation_budget_gib={budget!r} must be a number of GiB > 0 (e.g. 40), or None for the "
                "activations of TRL's flat forward."
            )
        if budget is not None and self.tree_recompute != "auto":
            raise ValueError(
                f"tree_activation_budget_gib={budget} bounds tree_recompute='auto', but tree_recompute="
                f"{self.tree_recompute!r} recomputes every layer: set tree_recompute='auto' or leave the budget None."
            )
        if self.tree_balance:
            reason = _balance_refusal(self)
            if reason:
                raise ValueError(f"tree_balance=True, but {reason} Set tree_balance=None (auto) or False.")
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


def _balance_refusal(args: TreeGRPOConfig) -> str | None:
    """Why moving rows between ranks would change this run's loss (None if it cannot)."""
    if args.loss_type == "bnpo":
        return "loss_type='bnpo' normalizes each micro-batch by its own token count, which moved rows change."
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        return "the entropy bonus is a mean over each micro-batch's tokens, which moved rows change."
    if args.top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 thresholds each micro-batch's entropies, which moved rows change."
    if args.per_device_train_batch_size % args.num_generations:
        return (
            f"per_device_train_batch_size={args.per_device_train_batch_size} is not a multiple of num_generations="
            f"{args.num_generations}, so whole groups cannot move: use a multiple."
        )
    return None
