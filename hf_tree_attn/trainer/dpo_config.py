"""`TreeDPOConfig`: `trl.DPOConfig` plus the tree-packing fields (`core.TreeOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig

from .core import TreeOptions

__all__ = ["TreeDPOConfig"]


@dataclass
class TreeDPOConfig(TreeOptions, DPOConfig):
    """`trl.DPOConfig` plus the tree-packing knobs (all other fields, defaults and checks are TRL's)."""
