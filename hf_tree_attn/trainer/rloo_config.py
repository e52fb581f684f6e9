"""`TreeRLOOConfig`: `trl.RLOOConfig` plus the group trainers' tree fields (`group_trainer.GroupTreeOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RLOOConfig

from .group_trainer import GroupTreeOptions

__all__ = ["TreeRLOOConfig"]


@dataclass
class TreeRLOOConfig(GroupTreeOptions, RLOOConfig):
    """`trl.RLOOConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's).

    RLOO's loss is a mean of per-sequence terms over each micro-batch of `per_device_train_batch_size` rows, so
    moving whole groups between ranks and micro-batches of one optimizer step (`tree_balance`) leaves it unchanged.
    """
