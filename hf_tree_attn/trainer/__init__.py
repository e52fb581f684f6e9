"""TRL trainers on packed prefix trees (needs `trl`: `pip install hf_tree_attn[train]`).

`hf_tree_attn` itself imports without trl; this subpackage is where the trl-dependent classes live.
"""

from .dpo_config import TreeDPOConfig
from .dpo_trainer import TreeDPOTrainer
from .grpo_config import TreeGRPOConfig
from .grpo_trainer import TreeGRPOTrainer
from .sft_config import TreeSFTConfig
from .sft_trainer import TreeSFTTrainer

__all__ = ["TreeDPOConfig", "TreeDPOTrainer", "TreeGRPOConfig", "TreeGRPOTrainer", "TreeSFTConfig", "TreeSFTTrainer"]
