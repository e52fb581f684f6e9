"""`TreeAsyncGRPOConfig`: TRL's `AsyncGRPOConfig` plus the recompute, compile and prefix-reuse fields (only the new
fields here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from .core import BLOCK, CompileOptions, check_prefix_reuse_fields
from .forest_step import PolicyForwardOptions

__all__ = ["TreeAsyncGRPOConfig"]


@dataclass
class TreeAsyncGRPOConfig(PolicyForwardOptions, CompileOptions, AsyncGRPOConfig):
    """`trl.experimental.async_grpo.AsyncGRPOConfig` plus how the tree forward recomputes activations
    (`forest_step.PolicyForwardOptions`), `tree_compile`, and `tree_prefix_reuse` / `tree_prefix_reuse_budget_gib`
    (one forest per optimizer step, scored in chunks of at most `token_budget` rows).

    Every other field, default and check is TRL's: the token budget (`token_budget`) and the planner that fills each
    rank's row, `max_staleness`, the weight-sync cadence, the model's `dtype`. Trees need no switch: the trainer
    always packs (a model the gate refuses is an error at init naming TRL's own trainer). The recompute bound of
    `tree_recompute="auto"` is TRL's own AsyncGRPOTrainer on the same row (its unique tokens, every layer
    checkpointed), so without `tree_activation_budget_gib` every layer recomputes, as in TRL; the peak memory of a
    whole step measured on an H200 was still up to 1.7x TRL's (benchmarks/results/README.md).
    """

    tree_prefix_reuse: bool = field(
        default=False,
        metadata={
            "help": "Score each optimizer step's rows (its gradient_accumulation_steps micro-batches, which TRL's "
            "planner fills up to token_budget tokens each) as one forest, in chunks of at most token_budget rows "
            "(hf_tree_attn.prefix_reuse): a prefix shared across rows (a GRPO group the planner split, a "
            "conversation's history) is forwarded once per step instead of once per row. Same loss, normalised per "
            "row as TRL does, and same gradients. A sample longer than token_budget, which TRL's planner drops, is "
            "kept alone in a row and trains in chunks along its length. Costs one recompute per chunk in the "
            "backward and holds the keys / "
            "values of the prefixes later chunks read until the step's last micro-batch. Refused at init for "
            "an MoE load-balancing loss, several processes other than DDP or FSDP2, DeepSpeed, FSDP1, "
            "reentrant gradient checkpointing, tree_activation_budget_gib and token_budget=0 (no token budget to "
            "size the chunks)."
        },
    )
    tree_prefix_reuse_budget_gib: float | None = field(
        default=None,
        metadata={
            "help": "With tree_prefix_reuse=True: GiB per device the step's chunked forest's estimated peak may take "
            "(hf_tree_attn.reuse_planner); each step then runs in the largest chunks of at most token_budget rows (a "
            "multiple of 128) that fit, and keeps the forward graphs of as many of the last chunks as the rest holds "
            "(each saving its recompute). Logged as tree_prefix_reuse_chunks, tree_prefix_reuse_kept_graphs, "
            "tree_prefix_reuse_kept_gib and tree_prefix_reuse_peak_gib. None (default) = chunks of token_budget "
            "rows, not priced, the last chunk's graph kept."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        budget = self.tree_prefix_reuse_budget_gib
        check_prefix_reuse_fields(self.tree_prefix_reuse, budget, "token_budget")
        if not self.tree_prefix_reuse:
            return
        if self.token_budget is not None and self.token_budget <= 0:
            raise ValueError(
                f"tree_prefix_reuse=True scores a step's forest in chunks of at most token_budget rows, but "
                f"token_budget={self.token_budget} batches by sample count (no token budget): set token_budget (e.g. "
                "the inference server's max_model_len, or None to read it from the server), or leave "
                "tree_prefix_reuse=False."
            )
        if budget is not None and self.token_budget is not None and self.token_budget < BLOCK:
            raise ValueError(
                f"tree_prefix_reuse_budget_gib={budget} sizes chunks in multiples of {BLOCK} rows of at most "
                f"token_budget={self.token_budget}, which holds none: use token_budget >= {BLOCK}, or leave the "
                "budget None (chunks of token_budget rows)."
            )
        if self.tree_activation_budget_gib is not None:
            raise ValueError(
                f"tree_activation_budget_gib={self.tree_activation_budget_gib} plans which layers a forest's forward "
                "recomputes, but with tree_prefix_reuse=True each chunk's backward recomputes the chunk whole (the "
                "model's own checkpointing applies inside it): leave tree_activation_budget_gib=None, or set "
                "tree_prefix_reuse=False."
            )
