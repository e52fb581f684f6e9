"""`TreeAsyncGRPOConfig`: TRL's `AsyncGRPOConfig` plus the recompute and compile fields (only the new fields here)."""

from __future__ import annotations

from dataclasses import dataclass

from trl.experimental.async_grpo import AsyncGRPOConfig

from .core import CompileOptions
from .forest_step import PolicyForwardOptions

__all__ = ["TreeAsyncGRPOConfig"]


@dataclass
class TreeAsyncGRPOConfig(PolicyForwardOptions, CompileOptions, AsyncGRPOConfig):
    """`trl.experimental.async_grpo.AsyncGRPOConfig` plus how the tree forward recomputes activations
    (`forest_step.PolicyForwardOptions`) and `tree_compile`.

    Every other field, default and check is TRL's: the token budget (`token_budget`) and the planner that fills each
    rank's row, `max_staleness`, the weight-sync cadence, the model's `dtype`. Trees need no switch: the trainer
    always packs (a model the gate refuses is an error at init naming TRL's own trainer). The recompute bound of
    `tree_recompute="auto"` is TRL's own AsyncGRPOTrainer on the same row (its unique tokens, every layer
    checkpointed), so without `tree_activation_budget_gib` every layer recomputes, as in TRL; the peak memory of a
    whole step measured on an H200 was still up to 1.7x TRL's (benchmarks/results/README.md).
    """
