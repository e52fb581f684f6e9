"""`TreeSFTConfig`: `trl.SFTConfig` plus the tree-packing fields (`core.TreeOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import SFTConfig

from .core import TreeOptions

__all__ = ["TreeSFTConfig"]


@dataclass
class TreeSFTConfig(TreeOptions, SFTConfig):
    """`trl.SFTConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's).

    What a batch shares is what TRL's sampler puts in it: samples that open with one system prompt share it in any
    batch; per-turn samples of one conversation share its history when they land in one batch
    (`train_sampling_strategy="sequential"` keeps a dataset's order).
    """
