"""`TreeAsyncGRPOConfig`: TRL's `AsyncGRPOConfig` plus the recompute and compile fields (only the new fields here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from .tree_options import check_tree_compile, tree_compile_field

__all__ = ["TreeAsyncGRPOConfig"]


@dataclass
class TreeAsyncGRPOConfig(AsyncGRPOConfig):
    """`trl.experimental.async_grpo.AsyncGRPOConfig` plus how the tree forward recomputes activations.

    Every other field, default and check is TRL's: the token budget (`token_budget`) and the planner that fills each
    rank's row, `max_staleness`, the weight-sync cadence, the model's `dtype`. Trees need no switch: the trainer
    always packs (a model the gate refuses is an error at init naming TRL's own trainer).
    """

    tree_recompute: str = field(
        default="auto",
        metadata={
            "help": "Activation recompute of the tree forward, with gradient_checkpointing on. 'all': every "
            "checkpointed layer recomputes (TRL's behaviour). 'auto': as few layers (evenly spaced) as keep the "
            "forest's estimated activations within what TRL's own AsyncGRPOTrainer holds for the same row (its "
            "unique tokens, every layer checkpointed: so every layer, as 'all'), or within "
            "tree_activation_budget_gib where that is more: then fewer layers recompute, and where the shared-prefix "
            "kernels serve a forest the checkpointed layers keep their attention output, so their recompute skips "
            "it. Layers the estimate does not price (experts, latent attention, recurrent mixers) recompute whole.",
            "choices": ["auto", "all"],
        },
    )
    tree_activation_budget_gib: float | None = field(
        default=None,
        metadata={
            "help": "With tree_recompute='auto': GiB per device the layer activations of one tree forward may take "
            "(an upper-bound estimate), where that is more than the row's activations with every layer "
            "checkpointed. A larger budget trades memory for speed: fewer layers recompute (logged as "
            "tree_checkpointed_layers). None (default): the every-layer bound: the checkpointed layers keep what "
            "TRL's do, though the peak memory of a whole step measured on an H200 was up to 1.7x TRL's "
            "(benchmarks/results/README.md)."
        },
    )

    tree_compile: str = tree_compile_field()

    def __post_init__(self):
        super().__post_init__()
        check_tree_compile(self)
        if self.tree_recompute not in ("auto", "all"):
            raise ValueError(f"tree_recompute={self.tree_recompute!r} must be 'auto' or 'all'.")
        budget = self.tree_activation_budget_gib
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0):
            raise ValueError(
                f"tree_activation_budget_gib={budget!r} must be a number of GiB > 0 (e.g. 40), or None for the "
                "activations of the row with every layer checkpointed."
            )
        if budget is not None and self.tree_recompute != "auto":
            raise ValueError(
                f"tree_activation_budget_gib={budget} bounds tree_recompute='auto', but tree_recompute="
                f"{self.tree_recompute!r} recomputes every layer: set tree_recompute='auto' or leave the budget None."
            )
        if not 0 < self.temperature < float("inf"):
            raise ValueError(
                f"temperature={self.temperature}: the tree log-probabilities divide the logits by the sampling "
                "temperature (as TRL does), so it must be a finite number > 0, e.g. temperature=1.0."
            )
