"""TRL trainers on packed prefix trees (needs `trl`: `pip install hf_tree_attn[train]`).

`hf_tree_attn` itself imports without trl; this subpackage is where the trl-dependent classes live.
"""

from .grpo_config import TreeGRPOConfig
from .grpo_trainer import TreeGRPOTrainer

__all__ = ["TreeGRPOConfig", "TreeGRPOTrainer"]
