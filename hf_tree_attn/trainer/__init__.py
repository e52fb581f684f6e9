"""TRL trainers on packed prefix trees (needs `trl`: `pip install hf_tree_attn[train]`).

`hf_tree_attn` itself imports without trl; this subpackage is where the trl-dependent classes live. Every TRL
internal they use is in `trl_compat`, which refuses a TRL outside the tested range (`trl_compat.TRL_REQUIREMENT`)
with an `ImportError` naming the fix; it is imported first, so that is the error another TRL gets. The asynchronous
trainer builds on `trl.experimental`, which warns on import: it is loaded on first use.
"""

from . import trl_compat  # noqa: F401  (first: its TRL version check runs before any trainer imports TRL)
from .dpo_config import TreeDPOConfig
from .dpo_trainer import TreeDPOTrainer
from .grpo_config import TreeGRPOConfig
from .grpo_trainer import TreeGRPOTrainer
from .reward_config import TreeRewardConfig
from .reward_trainer import TreeRewardTrainer
from .rloo_config import TreeRLOOConfig
from .rloo_trainer import TreeRLOOTrainer
from .sft_config import TreeSFTConfig
from .sft_trainer import TreeSFTTrainer

_ASYNC_CLASSES = {
    "TreeAsyncGRPOConfig": "async_grpo_config",
    "TreeAsyncGRPOTrainer": "async_grpo_trainer",
}


def __getattr__(name: str):
    if name in _ASYNC_CLASSES:
        import importlib

        return getattr(importlib.import_module(f".{_ASYNC_CLASSES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TreeAsyncGRPOConfig",
    "TreeAsyncGRPOTrainer",
    "TreeDPOConfig",
    "TreeDPOTrainer",
    "TreeGRPOConfig",
    "TreeGRPOTrainer",
    "TreeRewardConfig",
    "TreeRewardTrainer",
    "TreeRLOOConfig",
    "TreeRLOOTrainer",
    "TreeSFTConfig",
    "TreeSFTTrainer",
]
