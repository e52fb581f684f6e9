"""`TreeRewardConfig`: `trl.RewardConfig` plus the tree-packing fields (only the new fields live here)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RewardConfig

from .tree_options import (
    check_tree_options,
    max_tokens_per_mb_field,
    tree_compile_field,
    tree_max_token_ratio_field,
    tree_packing_field,
)

__all__ = ["TreeRewardConfig"]


@dataclass
class TreeRewardConfig(RewardConfig):
    """`trl.RewardConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's).

    A batch's chosen and rejected rows share their prompt, and pairs of one prompt in a batch share it too: each
    prompt is one trie, computed once.
    """

    tree_packing: str = tree_packing_field("RewardTrainer")
    max_tokens_per_mb: int | None = max_tokens_per_mb_field()
    tree_max_token_ratio: float = tree_max_token_ratio_field()
    tree_compile: str = tree_compile_field()

    def __post_init__(self):
        super().__post_init__()
        check_tree_options(self)
