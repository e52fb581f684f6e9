"""`TreeGRPOConfig`: `trl.GRPOConfig` plus the group trainers' tree fields (`group_trainer.GroupTreeOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig

from .group_trainer import GroupTreeOptions

__all__ = ["TreeGRPOConfig"]


@dataclass
class TreeGRPOConfig(GroupTreeOptions, GRPOConfig):
    """`trl.GRPOConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's)."""

    def tree_balance_refusal(self) -> str | None:
        """Why moving rows between ranks would change this run's loss (None if it cannot): GRPO's losses that work
        within a micro-batch, then the group trainers' reasons."""
        if self.loss_type == "bnpo":
            return "loss_type='bnpo' normalizes each micro-batch by its own token count, which moved rows change."
        if self.entropy_coef != 0.0 or self.use_adaptive_entropy:
            return "the entropy bonus is a mean over each micro-batch's tokens, which moved rows change."
        if self.top_entropy_quantile < 1.0:
            return "top_entropy_quantile < 1 thresholds each micro-batch's entropies, which moved rows change."
        return super().tree_balance_refusal()
