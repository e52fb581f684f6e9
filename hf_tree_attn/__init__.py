"""Tree training for HuggingFace Transformers: pack prefix-sharing sequences into tries and score them at once.

`import hf_tree_attn` registers `attn_implementation="tree_flex"` with transformers (idempotent). A `tree_flex`
another package registered first is not replaced: the import raises, naming it (`attention.register`). The import
replaces no function of transformers: the state-carrying layers' kernels get their segment-wise tree versions
(`hf_tree_attn.transformers_compat`) when a model is checked for trees or a forest is packed.
"""

from .attention import ATTN_IMPLEMENTATION, register, tree_flex_attention
from .collator import TreeDataCollator, TreeMicroBatch
from .hidden_states import forest_hidden_states, gather_hidden_states
from .logprobs import forest_logprobs, gather_sequences, pad_sequences, sequence_logprobs
from .metrics import estimate_flops
from .support import check_tree_model, tree_support_error
from .tree import PackedForest, pack_forest, tree_token_ratio

register()

__version__ = "0.1.0"

_TRAINER_CLASSES = (
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
)


def __getattr__(name: str):
    # The trainer needs trl, which `import hf_tree_attn` must not: load it on first use.
    if name in _TRAINER_CLASSES:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTN_IMPLEMENTATION",
    "PackedForest",
    "TreeAsyncGRPOConfig",
    "TreeAsyncGRPOTrainer",
    "TreeDPOConfig",
    "TreeDPOTrainer",
    "TreeDataCollator",
    "TreeGRPOConfig",
    "TreeGRPOTrainer",
    "TreeMicroBatch",
    "TreeRewardConfig",
    "TreeRewardTrainer",
    "TreeRLOOConfig",
    "TreeRLOOTrainer",
    "TreeSFTConfig",
    "TreeSFTTrainer",
    "check_tree_model",
    "estimate_flops",
    "forest_hidden_states",
    "forest_logprobs",
    "gather_hidden_states",
    "gather_sequences",
    "pack_forest",
    "pad_sequences",
    "register",
    "sequence_logprobs",
    "tree_flex_attention",
    "tree_support_error",
    "tree_token_ratio",
]
