"""`TreeRewardConfig`: `trl.RewardConfig` plus the tree-packing fields (`core.TreeOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RewardConfig

from .core import TreeOptions

__all__ = ["TreeRewardConfig"]


@dataclass
class TreeRewardConfig(TreeOptions, RewardConfig):
    """`trl.RewardConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's).

    A batch's chosen and rejected rows share their prompt, and pairs of one prompt in a batch share it too: each
    prompt is one trie, computed once.
    """
